"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.scheduling.request import RequestOutput
from dgpp.engine.server.core.priority import request_priority
from dgpp.engine.server.core.sessions import request_session
from dgpp.engine.server.openai import bodies as openai_bodies
from dgpp.engine.server.openai import prompt_scores
from dgpp.engine.server.openai.protocol import CompletionRequest
from dgpp.engine.server.pipeline.api_sampling import (
    ApiSampling,
    check_unsupported,
    resolve_max_tokens,
)
from dgpp.engine.server.pipeline.pipeline import (
    GenerationJob,
    OpenAIStream,
    complete,
    prepare,
    stream_response,
)
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.routes.deps import State, Tracker
from dgpp.engine.tokenization.tokenizer import check_token_ids

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
    state.check_kind("generate", "POST /v1/completions")
    check_unsupported(request)
    prompts = await asyncio.to_thread(_completion_prompts, state, request)  # off the event loop
    if request.stream and len(prompts) > 1:
        raise InvalidRequestError("streaming supports one prompt per request", param="prompt")
    scored, score_only = prompt_scores.scoring(request)
    requested = 16 if request.max_tokens is None else request.max_tokens  # OpenAI's default
    requested = max(requested, 1)  # max_tokens 0: one token generated and dropped
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    sampling = ApiSampling.of(request)
    priority = request_priority(state.config.api_keys, client, request.priority)
    session = request_session(state.config.api_keys, client, request.prompt_cache_key)
    jobs = [
        prepare(
            state,
            f"{request_id}-{number}",
            prompt,
            sampling,
            resolve_max_tokens(requested, len(prompt), state, "max_tokens"),
            n=request.n,
            logprobs=request.logprobs,
            use_prefix_cache=request.prefix_cache,
            prompt_logprobs=scored,
            priority=priority,
            session=session,
        )
        for number, prompt in enumerate(prompts)
    ]
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        shape = _CompletionStream(state, jobs[0], base, request.echo, include_usage)
        return stream_response(state, tracker, jobs[0], shape)
    choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
    results = await complete(state, tracker, jobs, client)
    for job, outputs in zip(jobs, results, strict=True):
        prompt = job.prompt
        prompt_tokens += len(prompt)
        cached_tokens += outputs[0].num_cached_tokens
        for output in outputs:
            completion = output.outputs[0]
            prefix = state.tokenizer.decode(prompt) if request.echo else ""
            text, count = prompt_scores.generated(completion, score_only)
            choice = {
                "index": len(choices),
                "text": prefix + text,
                "logprobs": prompt_scores.choice_logprobs(state.tokenizer, request, prompt, output),
                "finish_reason": openai_bodies.finish_reason(completion),
            }
            if request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_scores.vllm_prompt_logprobs(
                    state.tokenizer, output
                )
            choices.append(choice)
            completion_tokens += count
    return JSONResponse(
        {
            **base,
            "choices": choices,
            "usage": openai_bodies.usage(prompt_tokens, completion_tokens, 0, cached_tokens),
        }
    )


class _CompletionStream(OpenAIStream):
    """Completions chunks: the echoed prompt when asked, text deltas, a finish chunk per
    choice, then the usage chunk when asked and `[DONE]`."""

    def __init__(
        self,
        state: ServerState,
        job: GenerationJob,
        base: dict[str, Any],
        echo: bool,
        include_usage: bool,
    ) -> None:
        self.state, self.job, self.base = state, job, base
        self.echo, self.include_usage = echo, include_usage

    def _chunk(self, index: int, text: str, finish: str | None, logprobs: Any = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return openai_bodies.sse({**self.base, "choices": [choice]})

    def opening(self) -> list[str]:
        if not self.echo:
            return []
        text = self.state.tokenizer.decode(self.job.prompt)
        return [self._chunk(index, text, None) for index in range(len(self.job.params))]

    def output(self, index: int, output: RequestOutput) -> list[str]:
        completion = output.outputs[0]
        logprobs = None
        if completion.logprobs is not None and output.num_new_tokens:
            new = completion.logprobs[-output.num_new_tokens :]
            logprobs = openai_bodies.completion_logprobs(self.state.tokenizer, new, 0)
        events = []
        if output.text_delta or logprobs is not None:
            events.append(self._chunk(index, output.text_delta, None, logprobs))
        if output.finished:
            events.append(self._chunk(index, "", openai_bodies.finish_reason(completion)))
        return events
