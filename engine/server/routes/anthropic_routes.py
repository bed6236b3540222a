"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages API)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dgpp.engine.errors import DgppError
from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput
from dgpp.engine.server.anthropic.convert import to_chat_messages, to_openai_tools
from dgpp.engine.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from dgpp.engine.server.chat.reasoning_knobs import template_kwargs
from dgpp.engine.server.core.errors import anthropic_body, from_dgpp_error
from dgpp.engine.server.core.priority import request_priority
from dgpp.engine.server.core.sessions import request_session
from dgpp.engine.server.metrics.service import RequestTracker
from dgpp.engine.server.pipeline.api_sampling import ApiSampling, resolve_max_tokens
from dgpp.engine.server.pipeline.chat_prompt import render_chat
from dgpp.engine.server.pipeline.pipeline import (
    GenerationJob,
    StreamTotals,
    complete,
    prepare,
    stream_response,
)
from dgpp.engine.server.pipeline.response_parser import ResponseParser
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.pipeline.structured import checked, forced_call_grammar
from dgpp.engine.server.pipeline.thinking_budget import budget_params
from dgpp.engine.server.pipeline.tool_choice import (
    ForcedStart,
    anthropic_choice,
    forced_start,
    with_forced_start,
)
from dgpp.engine.server.routes.deps import State, Tracker

router = APIRouter()


def _prompt(
    state: ServerState, request: CountTokensRequest, forced: ForcedStart | None = None
) -> list[int]:
    kwargs = template_kwargs(
        state.config.default_chat_template_kwargs,
        effort=(request.output_config.effort if request.output_config else None)
        or state.config.default_reasoning_effort,
        thinking=request.thinking.type if request.thinking else None,
    )
    tools = to_openai_tools(request)
    messages = to_chat_messages(request)
    prompt = render_chat(state, messages, tools, kwargs, True, request.mm_processor_kwargs)
    return with_forced_start(state.tokenizer, prompt, forced)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: CountTokensRequest, state: State) -> dict[str, int]:
    state.check_model(request.model)
    return {"input_tokens": len(await asyncio.to_thread(_prompt, state, request))}


def _stop_reason(completion: CompletionOutput, has_tool_calls: bool) -> tuple[str, str | None]:
    if has_tool_calls:
        return "tool_use", None
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """Anthropic counts cache reads apart from `input_tokens` (their sum is the prompt)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def _thinking_budget(
    state: ServerState,
    request: MessagesRequest,
    parser: ResponseParser,
    grammar: str | None,
    max_tokens: int,
) -> dict[str, Any]:
    """`thinking.budget_tokens` (thinking disabled: none at all), else the effort, as the
    reasoning budget (`pipeline.thinking_budget`)."""
    thinking, config = request.thinking, request.output_config
    effort = config.effort if config else None
    if thinking is not None and thinking.type == "disabled":
        effort = "none"
    tokens = thinking.budget_tokens if thinking is not None and effort != "none" else None
    return budget_params(state, parser, grammar, max_tokens, effort, tokens)


@router.post("/v1/messages", response_model=None)
async def messages(
    request: MessagesRequest, state: State, tracker: Tracker, client: Request
) -> JSONResponse | StreamingResponse:
    model = state.check_model(request.model)
    state.check_kind("generate", "POST /v1/messages")
    tools = to_openai_tools(request)
    name, required = anthropic_choice(request.tool_choice)
    forced = forced_start(state.tokenizer.chat_template or "", tools, name, required)
    # A forced tool's input must match its input_schema (every Anthropic tool is a contract).
    grammar = forced_call_grammar(tools or [], forced, name, strict=True)
    grammar = await checked(state, grammar, "tools")
    prompt = await asyncio.to_thread(_prompt, state, request, forced)  # off the event loop
    max_tokens = resolve_max_tokens(
        request.max_tokens, len(prompt), state, "max_tokens", prompt_param="messages"
    )
    sampling = ApiSampling(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop=tuple(request.stop_sequences or ()),
    )
    job = prepare(
        state,
        f"msg_{uuid.uuid4().hex[:24]}",
        prompt,
        sampling,
        max_tokens,
        grammar=grammar,
        parser=lambda: ResponseParser(
            state, prompt, tools, forced, image_coordinates=request.image_coordinates
        ),
        budget=lambda parser: _thinking_budget(state, request, parser, grammar, max_tokens),
        priority=request_priority(state.config.api_keys, client),
        session=request_session(state.config.api_keys, client, None, request.metadata),
    )
    if request.stream:
        return stream_response(state, tracker, job, _MessageStream(tracker, job, model))
    ((output,),) = await complete(state, tracker, [job], client)
    (parser,) = job.parsers
    completion = output.outputs[0]
    parsed = parser.parse_whole(completion.text)
    tracker.tool_calls(parser.num_tool_calls)
    content: list[dict[str, Any]] = []
    reasoning, text = parsed.reasoning, parsed.content
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text:
        content.append({"type": "text", "text": text})
    for call in parser.tool_calls():
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": _json_object(call["function"]["arguments"]),
            }
        )
    stop_reason, stop_sequence = _stop_reason(completion, bool(parser.num_tool_calls))
    return JSONResponse(
        {
            "id": job.request_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(len(prompt), len(completion.token_ids), output.num_cached_tokens),
        }
    )


def _json_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {"_raw": arguments}


def _event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Blocks:
    """Opens and closes Anthropic content blocks as the kind of streamed output changes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.tool_index: int | None = None

    def switch(self, kind: str, start: dict[str, Any], tool_index: int | None = None) -> list[str]:
        if self.kind == kind and self.tool_index == tool_index:
            return []
        events = self.close()
        self.index += 1
        self.kind, self.tool_index = kind, tool_index
        events.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": start},
            )
        )
        return events

    def delta(self, delta: dict[str, Any]) -> str:
        return _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


class _MessageStream:
    """Anthropic stream events: message_start, content blocks opened and closed as the kind of
    output changes (thinking, text, tool_use), message_delta with the stop reason, message_stop;
    `ping` keeps the connection alive."""

    keepalive = _event("ping", {"type": "ping"})

    def __init__(self, tracker: RequestTracker, job: GenerationJob, model: str) -> None:
        self.tracker, self.job, self.model = tracker, job, model
        self.blocks = _Blocks()

    def opening(self) -> list[str]:
        start = {
            "id": self.job.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(len(self.job.prompt), 0),
        }
        return [
            _event("message_start", {"type": "message_start", "message": start}),
            self.keepalive,
        ]

    def output(self, index: int, output: RequestOutput) -> list[str]:
        parser = self.job.parsers[index]
        pieces = [parser.feed(output.text_delta)]
        if output.finished:
            pieces.append(parser.finish(output.outputs[0].text))
        events = [event for piece in pieces for event in _piece_events(self.blocks, piece)]
        if not output.finished:
            return events
        events += self.blocks.close()
        completion = output.outputs[0]
        self.tracker.tool_calls(parser.num_tool_calls)
        stop_reason, stop_sequence = _stop_reason(completion, bool(parser.num_tool_calls))
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {
                "output_tokens": len(completion.token_ids),
                "cache_read_input_tokens": output.num_cached_tokens,
            },
        }
        return [
            *events,
            _event("message_delta", delta),
            _event("message_stop", {"type": "message_stop"}),
        ]

    def failed(self, err: DgppError) -> list[str]:
        return [_event("error", anthropic_body(from_dgpp_error(err)))]

    def closing(self, totals: StreamTotals) -> list[str]:
        return []


def _piece_events(blocks: _Blocks, piece: Any) -> list[str]:
    events: list[str] = []
    if piece.reasoning:
        events += blocks.switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        events.append(blocks.delta({"type": "thinking_delta", "thinking": piece.reasoning}))
    if piece.content:
        events += blocks.switch("text", {"type": "text", "text": ""})
        events.append(blocks.delta({"type": "text_delta", "text": piece.content}))
    for call in piece.tool_calls:
        if call.id is not None:
            start = {"type": "tool_use", "id": call.id, "name": call.name or "", "input": {}}
            events += blocks.switch("tool_use", start, call.index)
        if call.arguments:
            events.append(
                blocks.delta({"type": "input_json_delta", "partial_json": call.arguments})
            )
    return events
