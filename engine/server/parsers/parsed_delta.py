"""What parsing a piece of a choice's output yields: content, reasoning and tool calls."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dgpp.engine.server.parsers.tool_parser import ToolCallDelta


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
