"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput
from dgpp.engine.server.chat.reasoning_knobs import template_kwargs
from dgpp.engine.server.core.priority import request_priority
from dgpp.engine.server.core.sessions import request_session
from dgpp.engine.server.metrics.service import RequestTracker
from dgpp.engine.server.openai import bodies as openai_bodies
from dgpp.engine.server.openai.protocol import ChatCompletionRequest
from dgpp.engine.server.pipeline.api_sampling import (
    ApiSampling,
    chat_logprobs,
    chat_max_tokens,
    resolve_max_tokens,
)
from dgpp.engine.server.pipeline.chat_prompt import render_chat
from dgpp.engine.server.pipeline.pipeline import (
    GenerationJob,
    OpenAIStream,
    complete,
    prepare,
    stream_response,
)
from dgpp.engine.server.pipeline.response_parser import ResponseParser
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.pipeline.structured import checked, forced_call_grammar, format_grammar
from dgpp.engine.server.pipeline.thinking_budget import budget_params
from dgpp.engine.server.pipeline.tool_choice import (
    ForcedStart,
    forced_start,
    openai_choice,
    with_forced_start,
)
from dgpp.engine.server.routes.deps import State, Tracker
from dgpp.engine.server.tool_formats.output_parser import ParsedDelta

router = APIRouter()


def _template_kwargs(state: ServerState, request: ChatCompletionRequest) -> dict[str, Any]:
    return template_kwargs(
        state.config.default_chat_template_kwargs,
        effort=request.reasoning_effort or state.config.default_reasoning_effort,
        explicit=request.chat_template_kwargs,
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    request: ChatCompletionRequest, state: State, tracker: Tracker, client: Request
) -> JSONResponse | StreamingResponse:
    model = state.check_model(request.model)
    state.check_kind("generate", "POST /v1/chat/completions")
    tools = request.tools if request.tool_choice != "none" else None
    name, required = openai_choice(request.tool_choice)
    forced = forced_start(state.tokenizer.chat_template or "", tools, name, required)
    if forced is not None:
        grammar = forced_call_grammar(tools or [], forced, name)
        grammar = await checked(state, grammar, "tools")
    else:
        grammar = format_grammar(request.response_format, "response_format")
        grammar = await checked(state, grammar, "response_format")
    # Rendering and tokenising a long conversation takes a while: off the event loop.
    prompt = await asyncio.to_thread(_prompt, state, request, tools, forced)
    requested, limit_name = chat_max_tokens(request)
    max_tokens = resolve_max_tokens(
        requested,
        len(prompt),
        state,
        limit_name,
        prompt_param="messages",
    )
    job = prepare(
        state,
        f"chatcmpl-{uuid.uuid4().hex}",
        prompt,
        ApiSampling.of(request),
        max_tokens,
        n=request.n,
        logprobs=chat_logprobs(request),
        grammar=grammar,
        use_prefix_cache=request.prefix_cache,
        budget=lambda parser: budget_params(
            state, parser, grammar, max_tokens, request.reasoning_effort
        ),
        priority=request_priority(state.config.api_keys, client, request.priority),
        session=request_session(state.config.api_keys, client, request.prompt_cache_key),
        parser=lambda: ResponseParser(
            state,
            prompt,
            tools,
            forced,
            request.skip_special_tokens,
            request.image_coordinates,
        ),
    )
    created = int(time.time())
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        shape = _ChatStream(state, tracker, job, created, model, include_usage)
        return stream_response(state, tracker, job, shape)
    (outputs,) = await complete(state, tracker, [job], client)
    choices = []
    reasoning_tokens = 0
    for index, (output, parser) in enumerate(zip(outputs, job.parsers, strict=True)):
        completion = output.outputs[0]
        parsed = parser.parse_whole(completion.text)
        content, reasoning = parsed.content, parsed.reasoning
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
            reasoning_tokens += len(state.tokenizer(reasoning, add_special_tokens=False).input_ids)
        if parser.num_tool_calls:
            tracker.tool_calls(parser.num_tool_calls)
            message["tool_calls"] = parser.tool_calls()
            message["content"] = content or None
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": openai_bodies.chat_logprobs(state.tokenizer, completion.logprobs)
                if completion.logprobs is not None
                else None,
                "finish_reason": _finish_reason(completion, parser.num_tool_calls),
            }
        )
    prompt_tokens, completion_tokens = openai_bodies.final(outputs)
    return JSONResponse(
        {
            "id": job.request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": openai_bodies.usage(
                prompt_tokens, completion_tokens, reasoning_tokens, outputs[0].num_cached_tokens
            ),
        }
    )


def _prompt(
    state: ServerState,
    request: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None,
    forced: ForcedStart | None,
) -> list[int]:
    prompt = render_chat(
        state,
        request.messages,
        tools,
        _template_kwargs(state, request),
        request.add_generation_prompt,
        request.mm_processor_kwargs,
    )
    return with_forced_start(state.tokenizer, prompt, forced)


def _finish_reason(completion: CompletionOutput, num_tool_calls: int) -> str | None:
    reason = openai_bodies.finish_reason(completion)
    return "tool_calls" if num_tool_calls and reason == "stop" else reason


def _delta(piece: ParsedDelta) -> dict[str, Any]:
    """The OpenAI chunk delta of one parsed piece (empty when nothing became certain)."""
    delta: dict[str, Any] = {}
    if piece.reasoning:
        delta["reasoning_content"] = piece.reasoning
    if piece.content:
        delta["content"] = piece.content
    if piece.tool_calls:
        calls = []
        for call in piece.tool_calls:
            entry: dict[str, Any] = {"index": call.index, "function": {"arguments": call.arguments}}
            if call.id is not None:
                entry.update(id=call.id, type="function")
                entry["function"]["name"] = call.name
            calls.append(entry)
        delta["tool_calls"] = calls
    return delta


class _ChatStream(OpenAIStream):
    """Chat Completions chunks: a role delta per choice, parsed deltas (reasoning, content,
    tool calls), a finish chunk per choice, then the usage chunk when asked and `[DONE]`."""

    def __init__(
        self,
        state: ServerState,
        tracker: RequestTracker,
        job: GenerationJob,
        created: int,
        model: str,
        include_usage: bool,
    ) -> None:
        self.state, self.tracker, self.job = state, tracker, job
        self.include_usage = include_usage
        self.base = {
            "id": job.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

    def _chunk(self, index: int, delta: dict[str, Any], **extra: Any) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return openai_bodies.sse({**self.base, "choices": [{**choice, **extra}]})

    def opening(self) -> list[str]:
        return [
            self._chunk(index, {"role": "assistant", "content": ""})
            for index in range(len(self.job.params))
        ]

    def output(self, index: int, output: RequestOutput) -> list[str]:
        completion = output.outputs[0]
        extra: dict[str, Any] = {}
        if completion.logprobs is not None and output.num_new_tokens:
            new = completion.logprobs[-output.num_new_tokens :]
            extra["logprobs"] = openai_bodies.chat_logprobs(self.state.tokenizer, new)
        parser = self.job.parsers[index]
        delta = _delta(parser.feed(output.text_delta))
        if output.finished:
            for key, value in _delta(parser.finish(completion.text)).items():
                delta[key] = delta.get(key, "" if key != "tool_calls" else []) + value
        events = [self._chunk(index, delta, **extra)] if delta or extra else []
        if output.finished:
            self.tracker.tool_calls(parser.num_tool_calls)
            finish = _finish_reason(completion, parser.num_tool_calls)
            events.append(self._chunk(index, {}, finish_reason=finish))
        return events
