"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dgpp.engine.async_engine import Admission
from dgpp.engine.errors import DgppError, InvalidRequestError
from dgpp.engine.server import openai_bodies
from dgpp.engine.server.api_sampling import (
    check_unsupported,
    resolve_max_tokens,
    sampling_params,
)
from dgpp.engine.server.deps import State, Tracker
from dgpp.engine.server.generation import Job, run_to_completion, stream_choices
from dgpp.engine.server.metrics import RequestTracker
from dgpp.engine.server.protocol import CompletionRequest
from dgpp.engine.server.state import ServerState
from dgpp.engine.tokenizer import check_token_ids

router = APIRouter()


def _completion_prompts(state: ServerState, request: CompletionRequest) -> list[list[int]]:
    raw = request.prompt
    if isinstance(raw, str):
        raw = [raw]
    if raw and all(isinstance(token, int) for token in raw):
        raw = [raw]  # one prompt of token ids
    prompts = []
    for prompt in raw:
        ids = state.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if not isinstance(prompt, str):  # checked now: a stream cannot turn into a 400 later
            check_token_ids(ids, state.engine.engine.model_config.vocab_size)
        prompts.append(list(ids))
    if not prompts:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return prompts


@router.post("/v1/completions", response_model=None)
async def completions(
    request: CompletionRequest, state: State, tracker: Tracker, client: Request
) -> JSONResponse | StreamingResponse:
    model = state.check_model(request.model)
    check_unsupported(request)
    prompts = await asyncio.to_thread(_completion_prompts, state, request)  # off the event loop
    if request.stream and len(prompts) > 1:
        raise InvalidRequestError("streaming supports one prompt per request", param="prompt")
    requested = 16 if request.max_tokens is None else request.max_tokens  # OpenAI's default
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    jobs = []
    for number, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(requested, len(prompt), state, "max_tokens")
        params = [
            sampling_params(
                request,
                max_tokens,
                request.logprobs,
                i,
                state.sampling_defaults,
                vocab_size=state.engine.engine.model_config.vocab_size,
            )
            for i in range(request.n)
        ]
        jobs.append(Job(prompt, params, f"{request_id}-{number}", request.prefix_cache))
    if request.stream:
        prompt, params = jobs[0].prompt, jobs[0].params
        admission = state.engine.admit(len(params))  # refused with a status code, or room held
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        events = _completion_stream(
            state, tracker, request, prompt, params, base, include_usage, admission
        )
        return StreamingResponse(
            events, media_type="text/event-stream", headers=openai_bodies.SSE_HEADERS
        )
    choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
    results = await run_to_completion(state, tracker, jobs, client)
    for job, outputs in zip(jobs, results, strict=True):
        prompt = job.prompt
        prompt_tokens += len(prompt)
        cached_tokens += outputs[0].num_cached_tokens
        for output in outputs:
            completion = output.outputs[0]
            prefix = state.tokenizer.decode(prompt) if request.echo else ""
            choices.append(
                {
                    "index": len(choices),
                    "text": prefix + completion.text,
                    "logprobs": openai_bodies.completion_logprobs(
                        state.tokenizer, completion.logprobs, len(prefix)
                    )
                    if completion.logprobs is not None
                    else None,
                    "finish_reason": openai_bodies.finish_reason(completion),
                }
            )
            completion_tokens += len(completion.token_ids)
    return JSONResponse(
        {
            **base,
            "choices": choices,
            "usage": openai_bodies.usage(prompt_tokens, completion_tokens, 0, cached_tokens),
        }
    )


async def _completion_stream(
    state: ServerState,
    tracker: RequestTracker,
    request: CompletionRequest,
    prompt: list[int],
    params: list,
    base: dict[str, Any],
    include_usage: bool,
    admission: Admission,
) -> AsyncIterator[str]:
    completion_tokens = cached_tokens = 0

    def chunk(index: int, text: str, finish: str | None, logprobs: Any = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return openai_bodies.sse({**base, "choices": [choice]})

    if request.echo:
        for index in range(len(params)):
            yield chunk(index, state.tokenizer.decode(prompt), None)
    try:
        async for item in stream_choices(
            state,
            tracker,
            prompt,
            params,
            base["id"],
            state.config.keepalive_interval_s,
            request.prefix_cache,
            admission,
        ):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            index, output = item
            completion = output.outputs[0]
            logprobs = None
            if completion.logprobs is not None and output.num_new_tokens:
                new = completion.logprobs[-output.num_new_tokens :]
                logprobs = openai_bodies.completion_logprobs(state.tokenizer, new, 0)
            if output.text_delta or logprobs is not None:
                yield chunk(index, output.text_delta, None, logprobs)
            if output.finished:
                completion_tokens += len(completion.token_ids)
                cached_tokens = max(cached_tokens, output.num_cached_tokens)
                yield chunk(index, "", openai_bodies.finish_reason(completion))
    except DgppError as err:
        yield openai_bodies.sse_error(err)
        return
    if include_usage:
        yield openai_bodies.sse(
            {
                **base,
                "choices": [],
                "usage": openai_bodies.usage(len(prompt), completion_tokens, 0, cached_tokens),
            }
        )
    yield openai_bodies.DONE
