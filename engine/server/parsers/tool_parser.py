"""Finds tool calls in the content of a chat completion, incrementally.

`ToolCallParser` finds blocks between an opening and a closing tag and hands each closed block's
body to a decoder of the model family's format (tool_format_*.py). Its defaults are the two
formats of Hermes/Qwen and Llama 3 models:

- Hermes/Qwen tags: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any number of
  them, after optional content. A block becomes a call once its closing tag arrives and its body is
  a JSON object with a non-empty string "name" and "arguments" (or "parameters") that is an object
  or a string (absent means `{}`). A closing tag inside one of that object's strings (a path or a
  shell command may hold one) does not close the block. Anything else — bad JSON, no name, an
  unclosed block at the end — comes out unchanged as content. Whitespace right after a call (the
  newlines between calls) is dropped.
- Llama 3 JSON: when the content, after leading whitespace, starts with "{", all of it is held until
  `finish`, which turns it into calls if it is one or more `{"name": ..., "parameters": {...}}`
  objects (or "arguments") separated by ";", and returns it unchanged as content otherwise. A JSON
  answer to a request that offered tools is therefore not streamed: one can only tell at the end.

Other families keep the block mechanics (a block that does not decode is content, whitespace after a
call is dropped) with their own tags and decoder, without the Llama 3 check, and may name markers
that are dropped wherever they appear in the content (the outer brackets around a run of calls).

Each call is emitted whole, as a single `ToolCallDelta` carrying id, name and the complete arguments
string, when it becomes certain. Streaming the arguments earlier was rejected on purpose: a block is
only known to be a valid call once it has closed, an invalid one must come out as content, and the
stream has to agree with the same text parsed whole.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from dgpp.engine.server.parsers.reasoning_parser import partial_tag_length

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_WHITESPACE = re.compile(r"\s*")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a tool call in OpenAI's streaming shape."""

    index: int  # position of this call among the message's tool calls
    id: str | None  # set on the first delta of a call, else None
    name: str | None  # set on the first delta of a call, else None
    arguments: str  # a piece of the JSON arguments string ("" allowed)

    def as_openai(self) -> dict[str, Any]:
        """The `choices[].delta.tool_calls[]` entry of a chat.completion.chunk."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call."""

    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict[str, Any]:
        """The `choices[].message.tool_calls[]` entry of a chat.completion."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolParse:
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


def call_fields(obj: object, keys: tuple[str, ...], *, required: bool) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of a decoded call object, or None when it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    present = [key for key in keys if key in obj]
    if not present and required:
        return None
    arguments = obj[present[0]] if present else {}
    if isinstance(arguments, dict):
        return name, json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        return name, arguments  # the model already wrote the JSON string
    return None


# A closed block's body to `(name, arguments JSON)`, or None when it is not a call (then content).
# A block's body to (name, arguments JSON), or (name, arguments, id) where the format names
# its calls itself (Kimi K2: `functions.NAME:INDEX`, which its template renders back); None
# when the body is not a call.
BodyDecoder = Callable[[str], tuple[str, str] | tuple[str, str, str] | None]


def hermes_call(body: str) -> tuple[str, str] | None:
    """A Hermes/Qwen block body: `{"name": ..., "arguments": {...}}`."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return call_fields(obj, ("arguments", "parameters"), required=False)


def _llama_calls(text: str) -> list[tuple[str, str]] | None:
    """Calls when `text` is only `;`-separated call objects, else None."""
    decoder = json.JSONDecoder()
    calls = []
    pos = _WHITESPACE.match(text).end()
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        # Both keys are required here: without them any JSON answer with a "name" would be a call.
        call = call_fields(obj, ("parameters", "arguments"), required=True)
        if call is None:
            return None
        calls.append(call)
        pos = _WHITESPACE.match(text, pos).end()
        if pos < len(text):
            if text[pos] != ";":
                return None
            pos = _WHITESPACE.match(text, pos + 1).end()
    return calls or None


def inside_json_string(text: str) -> bool:
    """True when `text` starts a JSON value (after spaces) and ends inside one of its strings."""
    start = _WHITESPACE.match(text).end()
    if not text.startswith(("{", "["), start):
        return False
    inside = escaped = False
    for char in text[start:]:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = inside
        elif char == '"':
            inside = not inside
    return inside


def first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """`(offset, tag)` of the tag that occurs first in `text` (the longest on a tie); -1 if none."""
    best, found = -1, ""
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best < 0 or at < best or (at == best and len(tag) > len(found))):
            best, found = at, tag
    return best, found


def held_length(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that may still become one of `tags`."""
    return max(partial_tag_length(text, tag) for tag in tags)


class _Mode(Enum):
    START = "start"  # only whitespace so far: the content may still be Llama 3 JSON
    TEXT = "text"  # plain content, watching for the opening tag
    BLOCK = "block"  # inside a tag block, waiting for the closing tag
    JSON = "json"  # the content began with "{": all held until finish
    DONE = "done"


class ToolCallParser:
    """Splits a content stream into plain content and tool calls. Not to be fed after `finish`.

    `decode`: a closed block's body to a call; `open_tag`/`close_tag`: the block's tags;
    `llama_json`: content that starts with "{" is held and tried as Llama 3 JSON at `finish`;
    `dropped`: markers removed from the content wherever they appear outside blocks (with
    the whitespace after them where `strip_after_dropped`, as after a call).
    """

    def __init__(
        self,
        decode: BodyDecoder = hermes_call,
        *,
        open_tag: str = CALL_OPEN,
        close_tag: str = CALL_CLOSE,
        llama_json: bool = True,
        dropped: tuple[str, ...] = (),
        strip_after_dropped: bool = False,
    ) -> None:
        self._decode = decode
        self._strip_after_dropped = strip_after_dropped
        self._open, self._close = open_tag, close_tag
        self._markers = (open_tag, *dropped)  # what the content is searched for
        self._mode = _Mode.START if llama_json else _Mode.TEXT
        # Text not yet returned: leading whitespace, a possible tag prefix, an open block's body,
        # or the held JSON.
        self._buffer = ""
        self._scan_from = 0  # in BLOCK: the closing tag cannot start before this offset
        self._strip_whitespace = False  # set by each call, cleared by the next non-space character
        self._calls: list[ToolCall] = []

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(self._calls)

    def feed(self, text: str) -> ToolParse:
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step(content, calls):
            pass
        return ToolParse("".join(content), tuple(calls))

    def finish(self) -> ToolParse:
        mode, held = self._mode, self._buffer
        self._mode, self._buffer = _Mode.DONE, ""
        if mode is _Mode.BLOCK:
            return ToolParse(self._open + held)
        if mode is _Mode.JSON:
            found = _llama_calls(held)
            if found is None:
                return ToolParse(held)
            return ToolParse("", tuple(self._add(name, arguments) for name, arguments in found))
        return ToolParse(held)  # leading whitespace or a partial tag: plain content

    def _step(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """One transition over the buffer; False once it must wait for more text."""
        if self._mode is _Mode.START:
            rest = self._buffer.lstrip()
            if not rest:
                return False
            self._mode = _Mode.JSON if rest.startswith("{") else _Mode.TEXT
            return self._mode is _Mode.TEXT
        if self._mode is _Mode.TEXT:
            return self._step_text(content)
        if self._mode is _Mode.BLOCK:
            return self._step_block(content, calls)
        return False

    def _step_text(self, content: list[str]) -> bool:
        if self._strip_whitespace:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._strip_whitespace = False
        at, tag = first_tag(self._buffer, self._markers)
        if at < 0:
            held = held_length(self._buffer, self._markers)
            content.append(self._buffer[: len(self._buffer) - held])
            self._buffer = self._buffer[len(self._buffer) - held :]
            return False
        content.append(self._buffer[:at])
        self._buffer = self._buffer[at + len(tag) :]
        if tag == self._open:
            self._mode, self._scan_from = _Mode.BLOCK, 0
        elif self._strip_after_dropped:  # the layout after a dropped marker goes with it
            self._strip_whitespace = True
        return True

    def _step_block(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        at = self._buffer.find(self._close, self._scan_from)
        if at < 0:
            # Only the last len(close) - 1 characters can begin a tag that later text closes.
            self._scan_from = max(0, len(self._buffer) - len(self._close) + 1)
            return False
        body = self._buffer[:at]
        if inside_json_string(body):
            self._scan_from = at + 1  # the tag is text inside an argument: the block goes on
            return True
        self._buffer = self._buffer[at + len(self._close) :]
        self._mode = _Mode.TEXT
        found = self._decode(body)
        if found is None:
            content.append(self._open + body + self._close)
        else:
            calls.append(self._add(*found))
            self._strip_whitespace = True
        return True

    def _add(self, name: str, arguments: str, call_id: str | None = None) -> ToolCallDelta:
        if call_id in {call.id for call in self._calls}:
            call_id = None  # the model repeated an id: the message's ids must stay unique
        call = ToolCall(id=call_id or new_call_id(), name=name, arguments=arguments)
        self._calls.append(call)
        return ToolCallDelta(index=len(self._calls) - 1, id=call.id, name=name, arguments=arguments)
