"""gpt-oss output in OpenAI's harmony format (GptOssForCausalLM), incrementally.

The prompt ends with `<|start|>assistant`, so the output begins inside the first message's header:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

A message is a header, `<|message|>`, a body, and `<|end|>`, `<|call|>` or `<|return|>` (the last
two are end-of-sequence tokens, so the body usually just ends with the output). The header says
where the body goes: a recipient (`to=functions.NAME`, before or after `<|channel|>`) makes it a
tool call with the body as its arguments when the request offered tools; otherwise channel
`analysis` is reasoning, and `final`, `commentary` (a preamble) or none is content. Headers are
held until `<|message|>`; bodies stream, except a call's, emitted whole when it ends. Output that
does not start like a header is plain content. Text between messages is content; a header cut
off by the end of the output is dropped.

Written here rather than taken from the `openai-harmony` package: that parses token ids with its
own vocabulary, which it downloads on first use (serving hosts may have no network), while dgpp's
parsers read the detokenized text, which keeps the markers because this format's output is decoded
with special tokens kept (output_format.py); every other special token is stripped afterwards.
"""

from __future__ import annotations

import json
import re
from enum import Enum

from dgpp.engine.server.parsers.parsed_delta import ParsedDelta
from dgpp.engine.server.parsers.tool_parser import (
    ToolCall,
    ToolCallDelta,
    first_tag,
    held_length,
    new_call_id,
)

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
_BODY_ENDS = (END, CALL, RETURN, START)  # a missing <|end|> before <|start|> ends a body too
_GAP_MARKERS = (START, CHANNEL)
_HEADER_STARTS = ("<|", " to=", "to=")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
FUNCTIONS = "functions."
ANALYSIS = "analysis"


class _Mode(Enum):
    START = "start"  # nothing decided: the output may open with a header
    HEADER = "header"  # a message header, held until <|message|>
    BODY = "body"  # a message body, up to its end marker
    GAP = "gap"  # after a message, before the next one's header
    DONE = "done"


class _Route(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"


class _Pieces:
    """What one feed or finish yields, gathered in order."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCallDelta] = []

    def delta(self) -> ParsedDelta:
        return ParsedDelta("".join(self.content), "".join(self.reasoning), tuple(self.calls))


def _arguments(text: str) -> str:
    """A call body as the arguments JSON string; text that is not a JSON object stays as it is
    (the recipient made it a call whatever the body holds)."""
    text = text.strip()
    if not text:
        return "{}"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else text


class HarmonyParser:
    """Splits harmony output into reasoning, content and tool calls. Not to be fed after
    `finish`. `tools`: the request offered tools (otherwise a call's body is content)."""

    def __init__(self, *, tools: bool) -> None:
        self._tools = tools
        self._mode = _Mode.START
        self._buffer = ""  # text not yet decided: a header, or a possible marker prefix
        self._route = _Route.CONTENT
        self._name = ""  # the function of the call being read
        self._arguments: list[str] = []  # its body so far
        self._calls: list[ToolCall] = []

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(self._calls)

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        pieces = _Pieces()
        while self._step(pieces):
            pass
        return pieces.delta()

    def finish(self) -> ParsedDelta:
        pieces = _Pieces()
        mode, held = self._mode, self._buffer
        self._mode, self._buffer = _Mode.DONE, ""
        if mode is _Mode.BODY:
            self._emit(held, pieces)
            if self._route is _Route.CALL:
                self._end_call(pieces)  # the body ended with the output (<|call|> is EOS)
        elif mode in (_Mode.START, _Mode.GAP):
            pieces.content.append(held)
        return pieces.delta()

    def _step(self, pieces: _Pieces) -> bool:
        """One transition over the buffer; False once it must wait for more text."""
        if self._mode is _Mode.START:
            return self._step_start()
        if self._mode is _Mode.HEADER:
            return self._step_header()
        if self._mode is _Mode.BODY:
            return self._step_body(pieces)
        if self._mode is _Mode.GAP:
            return self._step_gap(pieces)
        return False

    def _step_start(self) -> bool:
        text = self._buffer
        if any(len(text) < len(start) and start.startswith(text) for start in _HEADER_STARTS):
            return False  # empty, or too short to tell
        if text.startswith(_HEADER_STARTS):
            self._mode = _Mode.HEADER
        else:
            self._mode, self._route = _Mode.BODY, _Route.CONTENT
        return True

    def _step_header(self) -> bool:
        at = self._buffer.find(MESSAGE)
        if at < 0:
            return False
        self._open(self._buffer[:at])
        self._buffer = self._buffer[at + len(MESSAGE) :]
        self._mode = _Mode.BODY
        return True

    def _open(self, header: str) -> None:
        """Route the body that follows `header`."""
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        name = recipient.group(1).removeprefix(FUNCTIONS) if recipient else ""
        if name and self._tools:
            self._route, self._name, self._arguments = _Route.CALL, name, []
        elif channel is not None and channel.group(1) == ANALYSIS:
            self._route = _Route.REASONING
        else:
            self._route = _Route.CONTENT

    def _step_body(self, pieces: _Pieces) -> bool:
        at, tag = first_tag(self._buffer, _BODY_ENDS)
        if at < 0:
            cut = len(self._buffer) - held_length(self._buffer, _BODY_ENDS)
            self._emit(self._buffer[:cut], pieces)
            self._buffer = self._buffer[cut:]
            return False
        self._emit(self._buffer[:at], pieces)
        self._buffer = self._buffer[at + len(tag) :]
        if self._route is _Route.CALL:
            self._end_call(pieces)
        self._mode = _Mode.HEADER if tag == START else _Mode.GAP
        return True

    def _step_gap(self, pieces: _Pieces) -> bool:
        at, tag = first_tag(self._buffer, _GAP_MARKERS)
        if at < 0:
            cut = len(self._buffer) - held_length(self._buffer, _GAP_MARKERS)
            pieces.content.append(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return False
        pieces.content.append(self._buffer[:at])
        # A header may start at <|channel|> without <|start|>assistant; it keeps that marker.
        self._buffer = self._buffer[at + len(tag) :] if tag == START else self._buffer[at:]
        self._mode = _Mode.HEADER
        return True

    def _emit(self, text: str, pieces: _Pieces) -> None:
        if not text:
            return
        if self._route is _Route.CALL:
            self._arguments.append(text)
        elif self._route is _Route.REASONING:
            pieces.reasoning.append(text)
        else:
            pieces.content.append(text)

    def _end_call(self, pieces: _Pieces) -> None:
        call = ToolCall(new_call_id(), self._name, _arguments("".join(self._arguments)))
        self._calls.append(call)
        self._route, self._arguments = _Route.CONTENT, []
        index = len(self._calls) - 1
        pieces.calls.append(ToolCallDelta(index, call.id, call.name, call.arguments))
