"""Responses API output: the items of an answer, the response object, and its stream events
in the order OpenAI sends them (`response.output_item.added`, the deltas, `...done`)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dgpp.engine.server.responses.convert import ToolOrigins, custom_input
from dgpp.engine.server.tool_formats.output_parser import ParsedDelta


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [text_part(text)] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(
    call: dict[str, Any], origins: ToolOrigins, arguments: str | None = None
) -> dict[str, Any]:
    """From an OpenAI chat tool call (`{"id", "function": {"name", "arguments"}}`); a function
    of a namespace tool carries its `namespace`, a custom tool's call is a `custom_tool_call`
    with its free-text `input`. `arguments=""`: the item as it starts streaming."""
    function = call["function"]
    status = "completed" if arguments is None else "in_progress"
    written = function["arguments"] if arguments is None else arguments
    if function["name"] in origins.custom:
        return {
            "type": "custom_tool_call",
            "id": f"ctc_{call['id'].removeprefix('call_')}",
            "call_id": call["id"],
            "name": function["name"],
            "input": custom_input(written),
            "status": status,
        }
    item = {
        "type": "function_call",
        "id": f"fc_{call['id'].removeprefix('call_')}",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": written,
        "status": status,
    }
    if function["name"] in origins.namespaces:
        item["namespace"] = origins.namespaces[function["name"]]
    return item


def output_items(
    reasoning: str, text: str, calls: list[dict[str, Any]], origins: ToolOrigins
) -> list[dict[str, Any]]:
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if text or not calls:
        items.append(message_item(new_id("msg"), text))
    items.extend(function_call_item(call, origins) for call in calls)
    return items


def usage(prompt: int, output: int, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + output,
    }


@dataclass
class ResponseHead:
    """What the response object says about the request, fixed before generation starts."""

    model: str
    request: dict[str, Any]  # the request's echoed settings (instructions, tools, ...)
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage_: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model,
            "output": output,
            "usage": usage_,
            **self.request,
        }


class EventWriter:
    """Turns parsed output into Responses stream events; collects the final items."""

    def __init__(self, origins: ToolOrigins) -> None:
        self.origins = origins
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # "reasoning" or "message" while one is streaming
        self._text = ""
        self._id = ""

    def event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def feed(self, piece: ParsedDelta) -> list[str]:
        events: list[str] = []
        if piece.reasoning:
            events += self._ensure("reasoning")
            events.append(self._delta("response.reasoning_text.delta", piece.reasoning))
        if piece.content:
            events += self._ensure("message")
            events.append(self._delta("response.output_text.delta", piece.content))
        for call in piece.tool_calls:
            events += self.close()
            events += self._call(call.id or new_id("call"), call.name or "", call.arguments)
        return events

    def close(self) -> list[str]:
        """Finish the item being streamed, if any."""
        if self._open is None:
            return []
        index, item_id, text = len(self.items), self._id, self._text
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if self._open == "reasoning":
            item = reasoning_item(item_id, text)
            events = [self.event("response.reasoning_text.done", **where, text=text)]
        else:
            item = message_item(item_id, text)
            events = [
                self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=text_part(text)),
            ]
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        self._open = None
        return events

    def _ensure(self, kind: str) -> list[str]:
        if self._open == kind:
            return []
        events = self.close()
        self._open, self._text = kind, ""
        index = len(self.items)
        if kind == "reasoning":
            self._id = new_id("rs")
            item = {"type": "reasoning", "id": self._id, "summary": [], "content": []}
            events.append(self.event("response.output_item.added", output_index=index, item=item))
            return events
        self._id = new_id("msg")
        item = message_item(self._id, "", status="in_progress")
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        events.append(
            self.event(
                "response.content_part.added",
                item_id=self._id,
                output_index=index,
                content_index=0,
                part=text_part(""),
            )
        )
        return events

    def _delta(self, kind: str, text: str) -> str:
        self._text += text
        where = {"item_id": self._id, "output_index": len(self.items), "content_index": 0}
        return self.event(kind, **where, delta=text)

    def _call(self, call_id: str, name: str, arguments: str) -> list[str]:
        index = len(self.items)
        call = {"id": call_id, "function": {"name": name, "arguments": arguments}}
        started = function_call_item(call, self.origins, arguments="")
        done = function_call_item(call, self.origins)
        where = {"item_id": done["id"], "output_index": index}
        events = [self.event("response.output_item.added", output_index=index, item=started)]
        if done["type"] == "custom_tool_call":
            text = done["input"]
            if text:
                events.append(
                    self.event("response.custom_tool_call_input.delta", **where, delta=text)
                )
            events.append(self.event("response.custom_tool_call_input.done", **where, input=text))
        else:
            if arguments:
                events.append(
                    self.event("response.function_call_arguments.delta", **where, delta=arguments)
                )
            events.append(
                self.event(
                    "response.function_call_arguments.done", **where, name=name, arguments=arguments
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        return events
