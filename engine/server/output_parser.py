"""Incremental parsing of one chat-completion choice into content, reasoning and tool calls.

The model's text goes through `ReasoningSplitter` (when reasoning is parsed) and the content it
yields through `ToolCallParser` (when the request offered tools). Both hold back only text that may
still turn out to be markup, so feeding the output whole or in any chunks gives the same
concatenated content, reasoning and tool calls (ids aside, which are random). Text inside reasoning
is never searched for tool calls.

Streaming: feed each text delta, send back what each call returns, then send what `finish` returns.
Whole responses: `feed(text)` then `finish()`, merged with `merge`, and `tool_calls()` for the
message.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dgpp.engine.server.reasoning_parser import ReasoningSplit, ReasoningSplitter
from dgpp.engine.server.tool_parser import ToolCallDelta, ToolCallParser, ToolParse

__all__ = ["OutputParser", "ParsedDelta", "ToolCallDelta", "merge"]


@dataclass(frozen=True)
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls)


def merge(deltas: Iterable[ParsedDelta]) -> ParsedDelta:
    """The deltas of one choice joined in order, as if they had come out of a single call."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallDelta] = []
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        calls.extend(delta.tool_calls)
    return ParsedDelta("".join(content), "".join(reasoning), tuple(calls))


class OutputParser:
    """Parses one choice's output as it is generated.

    `reasoning`: split `<think>…</think>` off into reasoning (otherwise those tags are content).
    `tools`: find tool calls in the content (otherwise tool markup is content).
    `starts_in_reasoning`: the prompt ends inside an opened `<think>` (Qwen3 templates with thinking
    on), so the output begins as reasoning and closes it with `</think>`; ignored when `reasoning`
    is off, since everything is content then.
    """

    def __init__(self, *, reasoning: bool, tools: bool, starts_in_reasoning: bool = False) -> None:
        self._splitter = (
            ReasoningSplitter(starts_in_reasoning=starts_in_reasoning) if reasoning else None
        )
        self._tools = ToolCallParser() if tools else None
        self._finished = False

    @property
    def num_tool_calls(self) -> int:
        return len(self._tools.calls) if self._tools is not None else 0

    def tool_calls(self) -> list[dict[str, Any]]:
        """The complete calls so far, in the `message.tool_calls` shape of a chat.completion."""
        return [call.as_openai() for call in self._tools.calls] if self._tools is not None else []

    def feed(self, text: str) -> ParsedDelta:
        """Parse newly generated text; returns what became certain and holds back the rest."""
        if self._finished:
            raise RuntimeError("OutputParser.feed() called after finish()")
        split = (
            self._splitter.feed(text) if self._splitter is not None else ReasoningSplit("", text)
        )
        return self._route(split, final=False)

    def finish(self) -> ParsedDelta:
        """End of output: everything still held back, decided. Later calls return nothing."""
        if self._finished:
            return ParsedDelta()
        self._finished = True
        split = self._splitter.finish() if self._splitter is not None else ReasoningSplit()
        return self._route(split, final=True)

    def _route(self, split: ReasoningSplit, *, final: bool) -> ParsedDelta:
        if self._tools is None:
            return ParsedDelta(content=split.content, reasoning=split.reasoning)
        found = self._tools.feed(split.content)
        if final:
            rest = self._tools.finish()
            found = ToolParse(found.content + rest.content, found.calls + rest.calls)
        return ParsedDelta(content=found.content, reasoning=split.reasoning, tool_calls=found.calls)
