"""Runs the `n` choices of one API request on the engine, for whole responses and for streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from dgpp.engine.request import RequestOutput
from dgpp.engine.sampling_params import SamplingParams
from dgpp.engine.server.state import ServerState


async def run_to_completion(
    state: ServerState, prompt: list[int], params: list[SamplingParams], request_id: str
) -> list[RequestOutput]:
    """Every choice's final output, in choice order."""

    async def one(index: int) -> RequestOutput:
        last = None
        async for output in state.engine.generate(prompt, params[index], f"{request_id}-{index}"):
            last = output
        assert last is not None and last.finished
        return last

    tasks = [asyncio.create_task(one(index)) for index in range(len(params))]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # a failed or cancelled sibling must not leave the others running
            task.cancel()


async def stream_choices(
    state: ServerState,
    prompt: list[int],
    params: list[SamplingParams],
    request_id: str,
    keepalive_s: float,
) -> AsyncIterator[tuple[int, RequestOutput] | None]:
    """Yield (choice index, output) as the engine produces them, or None after `keepalive_s`
    without output (a long prefill), so the caller can keep the connection alive."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | int] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for output in state.engine.generate(
                prompt, params[index], f"{request_id}-{index}"
            ):
                await queue.put((index, output))
        except BaseException as err:
            await queue.put(err)
            raise
        await queue.put(index)  # this choice is done

    tasks = [asyncio.create_task(pump(index)) for index in range(len(params))]
    remaining = len(tasks)
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
            yield item
    finally:
        for task in tasks:
            task.cancel()
