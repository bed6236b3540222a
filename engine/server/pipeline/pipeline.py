"""The one request pipeline every API route runs (docs/api.md, "The request path").

A route turns its protocol's request into a `GenerationJob` (the rendered prompt, each choice's
sampling parameters, how the output is read, the cache hint) through `prepare`, then either
awaits the whole answer (`complete`) or streams it (`stream_response`): both take the room the
job needs first (an overloaded server refuses before anything runs). A stream runs one loop
for every protocol, with one keep-alive and one finish path; the route supplies only its
protocol's shapes (a `StreamShape`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Send

from dgpp.engine.async_engine import Admission
from dgpp.engine.errors import DgppError
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import RequestOutput
from dgpp.engine.server.metrics.service import Outcome, RequestTracker
from dgpp.engine.server.openai import bodies as openai_bodies
from dgpp.engine.server.pipeline.api_sampling import ApiSampling, sampling_params
from dgpp.engine.server.pipeline.generation import Job, run_to_completion, stream_choices
from dgpp.engine.server.pipeline.response_parser import ResponseParser, decoding_params
from dgpp.engine.server.pipeline.state import ServerState


@dataclass(frozen=True)
class GenerationJob:
    """One API request as the engine runs it."""

    request_id: str
    prompt: list[int]
    params: tuple[SamplingParams, ...]  # one per choice
    use_prefix_cache: bool = True
    # How each choice's text is read (reasoning, tool calls); empty: plain text (completions).
    parsers: tuple[ResponseParser, ...] = ()

    @property
    def engine_job(self) -> Job:
        return Job(self.prompt, list(self.params), self.request_id, self.use_prefix_cache)


def prepare(
    state: ServerState,
    request_id: str,
    prompt: list[int],
    sampling: ApiSampling,
    max_tokens: int,
    *,
    n: int = 1,
    logprobs: int | None = None,
    grammar: str | None = None,
    use_prefix_cache: bool = True,
    parser: Callable[[], ResponseParser] | None = None,
    budget: Callable[[ResponseParser], dict[str, object]] | None = None,
    prompt_logprobs: int | None = None,
    priority: int = 0,
    session: str | None = None,
) -> GenerationJob:
    """The job of one prompt: `n` choices sampled as `sampling` says (settings it leaves out
    from the checkpoint's generation config, else the API's defaults), each read by its own
    `parser()` when the output has a format, decoded as that format needs. `budget` adds
    sampling settings that depend on the parser (Anthropic's thinking budget); `priority`: the
    scheduling order (`core.priority.request_priority`); `session`: the agent session whose
    cached blocks it keeps (`core.sessions.request_session`)."""
    parsers = tuple(parser() for _ in range(n)) if parser is not None else ()
    vocab_size = state.engine.engine.model_config.vocab_size
    params = []
    for index in range(n):
        extra = budget(parsers[index]) if budget is not None and parsers else {}
        choice = sampling_params(
            sampling,
            max_tokens,
            logprobs,
            index,
            state.sampling_defaults,
            grammar,
            vocab_size,
            prompt_logprobs=prompt_logprobs,
            priority=priority,
            session=session,
            **extra,
        )
        params.append(decoding_params(state, choice) if parsers else choice)
    return GenerationJob(request_id, prompt, tuple(params), use_prefix_cache, parsers)


async def complete(
    state: ServerState,
    tracker: RequestTracker,
    jobs: list[GenerationJob],
    client: Request | None = None,
) -> list[list[RequestOutput]]:
    """Every job's final outputs, choice by choice (`generation.run_to_completion`)."""
    return await run_to_completion(state, tracker, [job.engine_job for job in jobs], client)


@dataclass
class StreamTotals:
    """What the finished choices of a stream add up to (for a usage chunk)."""

    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, output: RequestOutput) -> None:
        self.completion_tokens += len(output.outputs[0].token_ids)
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)


class StreamShape(Protocol):
    """A protocol's events around the one stream loop."""

    keepalive: str  # sent after `keepalive_interval_s` without output (a long prefill)

    def opening(self) -> list[str]: ...

    def output(self, index: int, output: RequestOutput) -> list[str]:
        """The events of one engine output of choice `index` (its finish among them when
        `output.finished`)."""
        ...

    def failed(self, err: DgppError) -> list[str]:
        """The events that end a stream the engine failed (the response has started, so no
        error handler answers)."""
        ...

    def closing(self, totals: StreamTotals) -> list[str]: ...


class OpenAIStream:
    """What chat and completions streams share: their keep-alive comment, an error event for a
    failed engine, and the end (the usage chunk when asked, then `[DONE]`). A subclass sets
    `base` (the chunk's id, object, created and model), `job` and `include_usage`."""

    keepalive = ": keep-alive\n\n"
    base: dict[str, Any]
    job: GenerationJob
    include_usage: bool

    def failed(self, err: DgppError) -> list[str]:
        return [openai_bodies.sse_error(err)]

    def closing(self, totals: StreamTotals) -> list[str]:
        return openai_bodies.stream_end(
            self.base,
            len(self.job.prompt),
            totals.completion_tokens,
            totals.cached_tokens,
            self.include_usage,
        )


def stream_response(
    state: ServerState, tracker: RequestTracker, job: GenerationJob, shape: StreamShape
) -> StreamingResponse:
    """The job streamed as server-sent events: the room for every choice is taken now (an
    overloaded server answers with a status code, not a broken stream)."""
    admission = state.engine.admit(len(job.params))

    def closed() -> None:
        admission.release()  # what the choices did not take (all, when they never started)
        tracker.finish(Outcome.CANCELLED)  # counted only when nothing counted it first

    events = _events(state, tracker, job, shape, admission)
    return _ClosingStream(
        events, closed, media_type="text/event-stream", headers=openai_bodies.SSE_HEADERS
    )


class _ClosingStream(StreamingResponse):
    """A `StreamingResponse` that closes its events when it ends, however it ends, then calls
    `closed`. Starlette cancels the response when the client disconnects; cancelled while it
    waits in `send` (the client stopped reading, the socket is full), it left the events
    generator suspended at a `yield`, so the choices kept generating (and holding KV blocks)
    for a client that was gone, until the garbage collector found the generator."""

    def __init__(
        self, events: AsyncIterator[str], closed: Callable[[], None], **options: Any
    ) -> None:
        super().__init__(events, **options)
        self.closed = closed

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.closed()


async def _events(
    state: ServerState,
    tracker: RequestTracker,
    job: GenerationJob,
    shape: StreamShape,
    admission: Admission,
) -> AsyncIterator[str]:
    for event in shape.opening():
        yield event
    totals = StreamTotals()
    choices = stream_choices(
        state,
        tracker,
        job.prompt,
        list(job.params),
        job.request_id,
        state.config.keepalive_interval_s,
        job.use_prefix_cache,
        admission,
    )
    try:
        # aclosing: leaving this loop by an exception (the response closed) closes the engine
        # side at once too: its choices are aborted and their room given back
        async with aclosing(choices) as items:
            async for item in items:
                if item is None:
                    yield shape.keepalive
                    continue
                index, output = item
                if output.finished:
                    totals.add(output)
                for event in shape.output(index, output):
                    yield event
    except DgppError as err:
        for event in shape.failed(err):
            yield event
        return
    for event in shape.closing(totals):
        yield event
