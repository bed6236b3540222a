"""Incremental parsing of one chat-completion choice into content, reasoning and tool calls.

For the tagged formats the model's text goes through `ReasoningSplitter` (when reasoning is
parsed) and the content it yields through the format's tool-call parser (when the request offered
tools); text inside reasoning is never searched for tool calls. Harmony output (gpt-oss) has its
own parser for all three. Where the output was decoded with special tokens kept, their text is
then stripped from content and reasoning. Every stage holds back only text that may still turn
out to be markup, so feeding the output whole or in any chunks gives the same concatenated
content, reasoning and tool calls (ids aside, which are random).

Streaming: feed each text delta, send back what each call returns, then send what `finish` returns.
Whole responses: `feed(text)` then `finish()`, merged with `merge`, and `tool_calls()` for the
message.
"""

from __future__ import annotations

from typing import Any, Protocol

from dgpp.engine.server.parsers.parsed_delta import ParsedDelta, merge
from dgpp.engine.server.parsers.reasoning_parser import ReasoningSplit, ReasoningSplitter
from dgpp.engine.server.parsers.special_tokens import SpecialTokenFilter, SpecialTokenText
from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.parsers.tool_parser import (
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolParse,
)
from dgpp.engine.server.tool_formats.harmony import HarmonyParser
from dgpp.engine.server.tool_formats.output_format import ToolFormat, content_tool_parser

__all__ = ["OutputParser", "ParsedDelta", "ToolCallDelta", "merge"]


class _Stages(Protocol):
    """Text in, parsed pieces out; `calls` are the complete calls so far."""

    @property
    def calls(self) -> tuple[ToolCall, ...]: ...

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


class _TaggedOutput:
    """`<think>` reasoning, then tool-call blocks in the content."""

    def __init__(self, splitter: ReasoningSplitter | None, tools: ToolCallParser | None) -> None:
        self._splitter = splitter
        self._tools = tools

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return self._tools.calls if self._tools is not None else ()

    def feed(self, text: str) -> ParsedDelta:
        split = (
            self._splitter.feed(text) if self._splitter is not None else ReasoningSplit("", text)
        )
        return self._route(split, final=False)

    def finish(self) -> ParsedDelta:
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


class OutputParser:
    """Parses one choice's output as it is generated.

    `reasoning`: split `<think>…</think>` off into reasoning (otherwise those tags are content).
    `tools`: find tool calls in the content (otherwise tool markup is content).
    `starts_in_reasoning`: the prompt ends inside an opened `<think>` (Qwen3 templates with thinking
    on), so the output begins as reasoning and closes it with `</think>`; ignored when `reasoning`
    is off, since everything is content then.
    `tool_format`: how the model writes tool calls (output_format.py); harmony also decides
    reasoning itself, by channel, so `reasoning` and `starts_in_reasoning` do not apply to it.
    `schemas`: the offered tools' parameter schemas, for formats that write arguments as text.
    `special_tokens`: strip these from content and reasoning (the output was decoded with them).
    """

    def __init__(
        self,
        *,
        reasoning: bool,
        tools: bool,
        starts_in_reasoning: bool = False,
        tool_format: ToolFormat = ToolFormat.HERMES,
        schemas: ToolSchemas | None = None,
        special_tokens: SpecialTokenText | None = None,
    ) -> None:
        self._stages: _Stages
        if tool_format is ToolFormat.HARMONY:
            self._stages = HarmonyParser(tools=tools)
        else:
            splitter = (
                ReasoningSplitter(starts_in_reasoning=starts_in_reasoning) if reasoning else None
            )
            calls = content_tool_parser(tool_format, schemas or ToolSchemas()) if tools else None
            self._stages = _TaggedOutput(splitter, calls)
        self._filters = (
            (SpecialTokenFilter(special_tokens), SpecialTokenFilter(special_tokens))
            if special_tokens is not None
            else None
        )
        self._finished = False

    @property
    def num_tool_calls(self) -> int:
        return len(self._stages.calls)

    def tool_calls(self) -> list[dict[str, Any]]:
        """The complete calls so far, in the `message.tool_calls` shape of a chat.completion."""
        return [call.as_openai() for call in self._stages.calls]

    def feed(self, text: str) -> ParsedDelta:
        """Parse newly generated text; returns what became certain and holds back the rest."""
        if self._finished:
            raise RuntimeError("OutputParser.feed() called after finish()")
        return self._filtered(self._stages.feed(text), final=False)

    def finish(self) -> ParsedDelta:
        """End of output: everything still held back, decided. Later calls return nothing."""
        if self._finished:
            return ParsedDelta()
        self._finished = True
        return self._filtered(self._stages.finish(), final=True)

    def _filtered(self, parsed: ParsedDelta, *, final: bool) -> ParsedDelta:
        if self._filters is None:
            return parsed
        content, reasoning = self._filters
        pieces = [ParsedDelta(content.feed(parsed.content), reasoning.feed(parsed.reasoning))]
        pieces.append(ParsedDelta(tool_calls=parsed.tool_calls))
        if final:
            pieces.append(ParsedDelta(content.finish(), reasoning.finish()))
        return merge(pieces)
