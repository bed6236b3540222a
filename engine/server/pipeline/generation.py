"""Runs the `n` choices of one API request on the engine, for whole responses and for streams,
and records the request in the service metrics (its outcome, and each finished choice)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from dgpp.engine.async_engine import Admission
from dgpp.engine.errors import DgppError
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import RequestOutput
from dgpp.engine.server.core.errors import ClientDisconnected, from_dgpp_error
from dgpp.engine.server.metrics.service import Outcome, RequestTracker, outcome_of
from dgpp.engine.server.pipeline.state import ServerState


@dataclass(frozen=True)
class Job:
    """One prompt and the sampling parameters of each of its choices."""

    prompt: list[int]
    params: list[SamplingParams]
    request_id: str
    use_prefix_cache: bool = True


async def run_to_completion(
    state: ServerState,
    tracker: RequestTracker,
    jobs: list[Job],
    client: Request | None = None,
) -> list[list[RequestOutput]]:
    """Every job's final outputs in choice order; all jobs run at once (the engine batches
    them). Room for every choice is taken first, so an overloaded server refuses the whole
    request before any of it runs. When `client` disconnects, every choice is aborted (their
    KV blocks return at the next step) and the request counts as cancelled; an error
    propagates to the error handlers, which count it."""
    admission = state.engine.admit(sum(len(job.params) for job in jobs))
    work = asyncio.ensure_future(
        asyncio.gather(*(_choices(state, tracker, job, admission) for job in jobs))
    )
    watch = asyncio.ensure_future(_disconnected(client)) if client is not None else None
    try:
        if watch is not None:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                raise ClientDisconnected
        results = await work
    except (asyncio.CancelledError, ClientDisconnected):
        tracker.finish(Outcome.CANCELLED)
        raise
    finally:
        work.cancel()
        # A choice that ends with an error while the request is being cancelled leaves it on
        # the gather; read it, so asyncio does not log "exception was never retrieved".
        work.add_done_callback(_consume_outcome)
        if watch is not None:
            watch.cancel()
        admission.release()
    tracker.finish(Outcome.SUCCEEDED)
    return list(results)


def _consume_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(client: Request) -> None:
    """Return once the client has gone (the ASGI server's `http.disconnect`)."""
    while True:
        message = await client.receive()
        if message["type"] == "http.disconnect":
            return


async def _choices(
    state: ServerState, tracker: RequestTracker, job: Job, admission: Admission
) -> list[RequestOutput]:
    async def one(index: int) -> RequestOutput:
        last = None
        async for output in state.engine.generate(
            job.prompt,
            job.params[index],
            f"{job.request_id}-{index}",
            job.use_prefix_cache,
            admission=admission,
        ):
            last = output
        assert last is not None and last.finished
        tracker.finished_choice(last)
        return last

    tasks = [asyncio.create_task(one(index)) for index in range(len(job.params))]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # a failed or cancelled sibling must not leave the others running
            task.cancel()


async def stream_choices(
    state: ServerState,
    tracker: RequestTracker,
    prompt: list[int],
    params: list[SamplingParams],
    request_id: str,
    keepalive_s: float,
    use_prefix_cache: bool = True,
    admission: Admission | None = None,
) -> AsyncIterator[tuple[int, RequestOutput] | None]:
    """Yield (choice index, output) as the engine produces them, or None after `keepalive_s`
    without output (a long prefill), so the caller can keep the connection alive.

    The response has started, so no error handler will see what goes wrong: the request's
    outcome is counted here (an engine error by its status, a client gone as cancelled).
    `admission` is the room the route took before it started the response; what it has left
    is given back when the stream ends."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | int] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for output in state.engine.generate(
                prompt,
                params[index],
                f"{request_id}-{index}",
                use_prefix_cache,
                admission=admission,
            ):
                await queue.put((index, output))
        except BaseException as err:
            await queue.put(err)
            raise
        await queue.put(index)  # this choice is done

    tasks = [asyncio.create_task(pump(index)) for index in range(len(params))]
    remaining = len(tasks)
    outcome = Outcome.FAILED
    try:
        while remaining:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=keepalive_s)
            except TimeoutError:
                yield None
                continue
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, int):
                remaining -= 1
                continue
            if item[1].finished:
                tracker.finished_choice(item[1])
            yield item
        outcome = Outcome.SUCCEEDED
    except DgppError as err:
        api = from_dgpp_error(err)
        outcome = outcome_of(api.status, api.code)
        raise
    except (asyncio.CancelledError, GeneratorExit):
        outcome = Outcome.CANCELLED
        raise
    finally:
        tracker.finish(outcome)
        for task in tasks:
            task.cancel()
        if admission is not None:
            admission.release()
