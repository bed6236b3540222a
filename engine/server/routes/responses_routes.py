"""POST /v1/responses, GET and DELETE /v1/responses/{id} (the OpenAI Responses API)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dgpp.engine.errors import DgppError, InvalidRequestError
from dgpp.engine.scheduling.request import RequestOutput
from dgpp.engine.server.chat.reasoning_knobs import template_kwargs
from dgpp.engine.server.core.errors import from_dgpp_error
from dgpp.engine.server.core.priority import request_priority
from dgpp.engine.server.core.sessions import request_session
from dgpp.engine.server.metrics.service import RequestTracker
from dgpp.engine.server.openai.protocol import ChatMessage
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
from dgpp.engine.server.pipeline.structured import checked, forced_call_grammar, format_grammar
from dgpp.engine.server.pipeline.thinking_budget import budget_params
from dgpp.engine.server.pipeline.tool_choice import (
    ForcedStart,
    forced_start,
    openai_choice,
    with_forced_start,
)
from dgpp.engine.server.responses.convert import to_chat_messages, to_chat_tools
from dgpp.engine.server.responses.output import EventWriter, ResponseHead, output_items, usage
from dgpp.engine.server.responses.protocol import ResponsesRequest
from dgpp.engine.server.routes.deps import State, Tracker
from dgpp.engine.server.tool_formats.output_parser import ParsedDelta

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
    image_options: dict[str, Any] | None = None,
) -> list[int]:
    kwargs = template_kwargs(state.config.default_chat_template_kwargs, effort=effort)
    prompt = render_chat(state, messages, tools, kwargs, True, image_options)
    return with_forced_start(state.tokenizer, prompt, forced)


@router.post("/v1/responses", response_model=None)
async def create_response(
    request: ResponsesRequest, state: State, tracker: Tracker, client: Request
) -> JSONResponse | StreamingResponse:
    model = state.check_model(request.model)
    state.check_kind("generate", "POST /v1/responses")
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
    effort = effort or state.config.default_reasoning_effort
    options = request.mm_processor_kwargs
    prompt = await asyncio.to_thread(_prompt, state, messages, tools, forced, effort, options)
    max_tokens = resolve_max_tokens(
        request.max_output_tokens, len(prompt), state, "max_output_tokens", prompt_param="input"
    )
    sampling = ApiSampling(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        seed=request.seed,
    )
    head = ResponseHead(model, _echo(request))
    job = prepare(
        state,
        head.id,
        prompt,
        sampling,
        max_tokens,
        grammar=grammar,
        use_prefix_cache=request.prefix_cache,
        priority=request_priority(state.config.api_keys, client, request.priority),
        session=request_session(state.config.api_keys, client, request.prompt_cache_key),
        budget=lambda parser: budget_params(state, parser, grammar, max_tokens, effort),
        parser=lambda: ResponseParser(
            state, prompt, tools, forced, image_coordinates=request.image_coordinates
        ),
    )
    turn = _Turn(state, request.store, conversation)
    if request.stream:
        shape = _ResponseStream(tracker, job, head, turn, EventWriter(origins))
        return stream_response(state, tracker, job, shape)
    ((output,),) = await complete(state, tracker, [job], client)
    (parser,) = job.parsers
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


class _ResponseStream:
    """Responses API events: response.created and .in_progress, the output items' events as
    `EventWriter` writes them, then response.completed (or .incomplete), or error and
    response.failed when the engine fails."""

    keepalive = ": keep-alive\n\n"

    def __init__(
        self,
        tracker: RequestTracker,
        job: GenerationJob,
        head: ResponseHead,
        turn: _Turn,
        writer: EventWriter,
    ) -> None:
        self.tracker, self.job, self.head, self.turn, self.writer = tracker, job, head, turn, writer
        self.pieces: list[ParsedDelta] = []

    def opening(self) -> list[str]:
        body = self.head.body("in_progress", [])
        return [
            self.writer.event("response.created", response=body),
            self.writer.event("response.in_progress", response=body),
        ]

    def output(self, index: int, output: RequestOutput) -> list[str]:
        parser, writer = self.job.parsers[index], self.writer
        new = [parser.feed(output.text_delta)]
        if output.finished:
            new.append(parser.finish(output.outputs[0].text))
        self.pieces += new
        events = [event for piece in new for event in writer.feed(piece)]
        if not output.finished:
            return events
        events += writer.close()
        self.tracker.tool_calls(parser.num_tool_calls)
        whole = ParsedDelta(
            content="".join(piece.content for piece in self.pieces),
            reasoning="".join(piece.reasoning for piece in self.pieces),
        )
        body = self.turn.finish(self.head, output, writer.items, whole, parser.tool_calls())
        incomplete = body["status"] == "incomplete"
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*events, writer.event(kind, response=body)]

    def failed(self, err: DgppError) -> list[str]:
        api = from_dgpp_error(err)
        error = {"code": api.code or "server_error", "message": api.message}
        failed = self.head.body("failed", self.writer.items, error=error)
        return [
            self.writer.event("error", code=api.code, message=api.message, param=api.param),
            self.writer.event("response.failed", response=failed),
        ]

    def closing(self, totals: StreamTotals) -> list[str]:
        return []


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: State) -> dict[str, Any]:
    return state.responses.get(response_id).body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: State) -> dict[str, Any]:
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
