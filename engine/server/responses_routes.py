"""POST /v1/responses, GET and DELETE /v1/responses/{id} (the OpenAI Responses API)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dgpp.engine.async_engine import Admission
from dgpp.engine.errors import DgppError, InvalidRequestError
from dgpp.engine.request import RequestOutput
from dgpp.engine.sampling_params import SamplingParams
from dgpp.engine.server import openai_bodies
from dgpp.engine.server.api_sampling import pick, resolve_max_tokens
from dgpp.engine.server.chat_render import normalise, render
from dgpp.engine.server.deps import State, Tracker
from dgpp.engine.server.errors import from_dgpp_error
from dgpp.engine.server.generation import Job, run_to_completion, stream_choices
from dgpp.engine.server.metrics import RequestTracker
from dgpp.engine.server.output_parser import ParsedDelta
from dgpp.engine.server.protocol import ChatMessage
from dgpp.engine.server.reasoning_knobs import template_kwargs
from dgpp.engine.server.response_parser import ResponseParser, decoding_params
from dgpp.engine.server.responses_convert import to_chat_messages, to_chat_tools
from dgpp.engine.server.responses_output import EventWriter, ResponseHead, output_items, usage
from dgpp.engine.server.responses_protocol import ResponsesRequest
from dgpp.engine.server.state import ServerState
from dgpp.engine.server.structured import checked, forced_call_grammar, format_grammar
from dgpp.engine.server.tool_choice import (
    ForcedStart,
    forced_start,
    openai_choice,
    with_forced_start,
)

router = APIRouter()


def _echo(request: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as the response object repeats them."""
    reasoning = request.reasoning
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "parallel_tool_calls": True
        if request.parallel_tool_calls is None
        else request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },
        "store": request.store,
        "temperature": request.temperature,
        "text": {"format": (request.text or {}).get("format") or {"type": "text"}},
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "top_p": request.top_p,
        "truncation": request.truncation or "disabled",
        "user": request.user,
    }


def _check_supported(request: ResponsesRequest) -> None:
    if request.background:
        raise InvalidRequestError("background responses are not supported", param="background")


def _prompt(
    state: ServerState,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    forced: ForcedStart | None,
    effort: str | None,
) -> list[int]:
    kwargs = template_kwargs(state.config.default_chat_template_kwargs, effort=effort)
    prompt = render(
        state.tokenizer,
        normalise(messages, state.template_traits),
        tools,
        kwargs,
        True,
        state.hint_system,
    )
    return with_forced_start(state.tokenizer, prompt, forced)


@router.post("/v1/responses", response_model=None)
async def create_response(
    request: ResponsesRequest, state: State, tracker: Tracker, client: Request
) -> JSONResponse | StreamingResponse:
    model = state.check_model(request.model)
    _check_supported(request)
    previous: tuple[ChatMessage, ...] = ()
    if request.previous_response_id is not None:
        previous = state.responses.get(
            request.previous_response_id, "previous_response_id"
        ).conversation
    conversation = [*previous, *to_chat_messages(request.input)]
    if not conversation:
        raise InvalidRequestError("input is empty", param="input")
    messages = conversation
    if request.instructions:
        messages = [ChatMessage(role="system", content=request.instructions), *conversation]
    tools, origins = to_chat_tools(request.tools)
    if request.tool_choice == "none":
        tools = None
    name, required = openai_choice(request.tool_choice)
    forced = forced_start(state.tokenizer.chat_template or "", tools, name, required)
    if forced is not None:
        grammar = await checked(state, forced_call_grammar(tools or [], forced, name), "tools")
    else:
        text_format = (request.text or {}).get("format")
        grammar = await checked(state, format_grammar(text_format, "text.format"), "text.format")
    effort = request.reasoning.effort if request.reasoning else None
    prompt = await asyncio.to_thread(_prompt, state, messages, tools, forced, effort)
    max_tokens = resolve_max_tokens(
        request.max_output_tokens, len(prompt), state, "max_output_tokens", prompt_param="input"
    )
    defaults = state.sampling_defaults
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=pick(request.temperature, defaults.temperature, 1.0),
        top_p=pick(request.top_p, defaults.top_p, 1.0),
        top_k=int(pick(request.top_k, defaults.top_k, 0)),
        min_p=pick(request.min_p, defaults.min_p, 0.0),
        repetition_penalty=pick(request.repetition_penalty, defaults.repetition_penalty, 1.0),
        seed=request.seed,
        grammar=grammar,
    )
    params = decoding_params(state, params)
    head = ResponseHead(model, _echo(request), use_prefix_cache=request.prefix_cache)
    parser = ResponseParser(state, prompt, tools, forced)
    turn = _Turn(state, request.store, conversation)
    if request.stream:
        admission = state.engine.admit()  # refused with a status code, or room held
        writer = EventWriter(origins)
        events = _stream(state, tracker, prompt, params, head, parser, turn, admission, writer)
        return StreamingResponse(
            events, media_type="text/event-stream", headers=openai_bodies.SSE_HEADERS
        )
    job = Job(prompt, [params], head.id, request.prefix_cache)
    ((output,),) = await run_to_completion(state, tracker, [job], client)
    parsed = parser.parse_whole(output.outputs[0].text)
    tracker.tool_calls(parser.num_tool_calls)
    items = output_items(parsed.reasoning, parsed.content, parser.tool_calls(), origins)
    return JSONResponse(turn.finish(head, output, items, parsed, parser.tool_calls()))


class _Turn:
    """Finishes a response: its final body, and the stored conversation when `store`."""

    def __init__(self, state: ServerState, store: bool, conversation: list[ChatMessage]) -> None:
        self.state = state
        self.store = store
        self.conversation = conversation

    def finish(
        self,
        head: ResponseHead,
        output: RequestOutput,
        items: list[dict[str, Any]],
        parsed: ParsedDelta,
        calls: list[dict[str, Any]],
    ) -> dict[str, Any]:
        completion = output.outputs[0]
        tokenizer = self.state.tokenizer
        reasoning_tokens = (
            len(tokenizer(parsed.reasoning, add_special_tokens=False).input_ids)
            if parsed.reasoning
            else 0
        )
        counts = usage(
            len(output.prompt_token_ids),
            len(completion.token_ids),
            output.num_cached_tokens,
            reasoning_tokens,
        )
        length = completion.finish_reason == "length"
        body = head.body(
            "incomplete" if length else "completed",
            items,
            counts,
            incomplete="max_output_tokens" if length else None,
        )
        if self.store:
            assistant = ChatMessage.model_validate(
                {
                    "role": "assistant",
                    "content": parsed.content,
                    "reasoning_content": parsed.reasoning or None,
                    "tool_calls": calls or None,
                }
            )
            self.state.responses.put(body, [*self.conversation, assistant])
        return body


async def _stream(
    state: ServerState,
    tracker: RequestTracker,
    prompt: list[int],
    params: SamplingParams,
    head: ResponseHead,
    parser: ResponseParser,
    turn: _Turn,
    admission: Admission,
    writer: EventWriter,
) -> AsyncIterator[str]:
    yield writer.event("response.created", response=head.body("in_progress", []))
    yield writer.event("response.in_progress", response=head.body("in_progress", []))
    pieces: list[ParsedDelta] = []
    try:
        async for item in stream_choices(
            state,
            tracker,
            prompt,
            [params],
            head.id,
            state.config.keepalive_interval_s,
            head.use_prefix_cache,
            admission,
        ):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            _, output = item
            new = [parser.feed(output.text_delta)]
            if output.finished:
                new.append(parser.finish(output.outputs[0].text))
            pieces += new
            for piece in new:
                for event in writer.feed(piece):
                    yield event
            if output.finished:
                for event in writer.close():
                    yield event
                tracker.tool_calls(parser.num_tool_calls)
                whole = ParsedDelta(
                    content="".join(p.content for p in pieces),
                    reasoning="".join(p.reasoning for p in pieces),
                )
                body = turn.finish(head, output, writer.items, whole, parser.tool_calls())
                kind = (
                    "response.incomplete"
                    if body["status"] == "incomplete"
                    else "response.completed"
                )
                yield writer.event(kind, response=body)
    except DgppError as err:
        api = from_dgpp_error(err)
        yield writer.event("error", code=api.code, message=api.message, param=api.param)
        error = {"code": api.code or "server_error", "message": api.message}
        yield writer.event(
            "response.failed", response=head.body("failed", writer.items, error=error)
        )


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: State) -> dict[str, Any]:
    return state.responses.get(response_id).body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: State) -> dict[str, Any]:
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
