"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dgpp.engine.async_engine import Admission
from dgpp.engine.errors import DgppError
from dgpp.engine.request import CompletionOutput
from dgpp.engine.server import openai_bodies
from dgpp.engine.server.api_sampling import (
    chat_logprobs,
    chat_max_tokens,
    resolve_max_tokens,
    sampling_params,
)
from dgpp.engine.server.chat_render import normalise, render
from dgpp.engine.server.deps import State, Tracker
from dgpp.engine.server.generation import Job, run_to_completion, stream_choices
from dgpp.engine.server.metrics import RequestTracker
from dgpp.engine.server.output_parser import ParsedDelta
from dgpp.engine.server.protocol import ChatCompletionRequest
from dgpp.engine.server.reasoning_knobs import template_kwargs
from dgpp.engine.server.response_parser import ResponseParser, decoding_params
from dgpp.engine.server.state import ServerState
from dgpp.engine.server.structured import checked, forced_call_grammar, format_grammar
from dgpp.engine.server.tool_choice import (
    ForcedStart,
    forced_start,
    openai_choice,
    with_forced_start,
)

router = APIRouter()


def _template_kwargs(state: ServerState, request: ChatCompletionRequest) -> dict[str, Any]:
    return template_kwargs(
        state.config.default_chat_template_kwargs,
        effort=request.reasoning_effort,
        explicit=request.chat_template_kwargs,
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    request: ChatCompletionRequest, state: State, tracker: Tracker, client: Request
) -> JSONResponse | StreamingResponse:
    model = state.check_model(request.model)
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
    logprobs = chat_logprobs(request)
    vocab_size = state.engine.engine.model_config.vocab_size
    params = [
        decoding_params(
            state,
            sampling_params(
                request, max_tokens, logprobs, i, state.sampling_defaults, grammar, vocab_size
            ),
        )
        for i in range(request.n)
    ]
    skip_special = request.skip_special_tokens
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if request.stream:
        admission = state.engine.admit(len(params))  # refused with a status code, or room held
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        parsers = [ResponseParser(state, prompt, tools, forced, skip_special) for _ in params]
        events = _chat_stream(
            state,
            tracker,
            prompt,
            params,
            request_id,
            created,
            model,
            include_usage,
            parsers,
            request.prefix_cache,
            admission,
        )
        return StreamingResponse(
            events, media_type="text/event-stream", headers=openai_bodies.SSE_HEADERS
        )
    (outputs,) = await run_to_completion(
        state, tracker, [Job(prompt, params, request_id, request.prefix_cache)], client
    )
    choices = []
    reasoning_tokens = 0
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        parser = ResponseParser(state, prompt, tools, forced, skip_special)
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
            "id": request_id,
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
    prompt = render(
        state.tokenizer,
        normalise(request.messages, state.template_traits),
        tools,
        _template_kwargs(state, request),
        request.add_generation_prompt,
        hint_system=state.hint_system,
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


async def _chat_stream(
    state: ServerState,
    tracker: RequestTracker,
    prompt: list[int],
    params: list,
    request_id: str,
    created: int,
    model: str,
    include_usage: bool,
    parsers: list[ResponseParser],
    use_prefix_cache: bool,
    admission: Admission,
) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return openai_bodies.sse({**base, "choices": [{**choice, **extra}]})

    for index in range(len(params)):
        yield chunk(index, {"role": "assistant", "content": ""})
    completion_tokens = cached_tokens = 0
    try:
        async for item in stream_choices(
            state,
            tracker,
            prompt,
            params,
            request_id,
            state.config.keepalive_interval_s,
            use_prefix_cache,
            admission,
        ):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            index, output = item
            completion = output.outputs[0]
            extra: dict[str, Any] = {}
            if completion.logprobs is not None and output.num_new_tokens:
                new = completion.logprobs[-output.num_new_tokens :]
                extra["logprobs"] = openai_bodies.chat_logprobs(state.tokenizer, new)
            parser = parsers[index]
            delta = _delta(parser.feed(output.text_delta))
            if output.finished:
                for key, value in _delta(parser.finish(completion.text)).items():
                    delta[key] = delta.get(key, "" if key != "tool_calls" else []) + value
            if delta or extra:
                yield chunk(index, delta, **extra)
            if output.finished:
                completion_tokens += len(completion.token_ids)
                cached_tokens = max(cached_tokens, output.num_cached_tokens)
                tracker.tool_calls(parser.num_tool_calls)
                finish = _finish_reason(completion, parser.num_tool_calls)
                yield chunk(index, {}, finish_reason=finish)
    except DgppError as err:
        yield openai_bodies.sse_error(err)
        return
    if include_usage:
        usage = openai_bodies.usage(len(prompt), completion_tokens, cached_tokens=cached_tokens)
        yield openai_bodies.sse({**base, "choices": [], "usage": usage})
    yield openai_bodies.DONE
