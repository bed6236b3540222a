"""Chooses and drives the output parser of a request: reasoning if the template knows `<think>`,
tool calls if tools are on, and a forced tool-call opening for `required`/named tool choices."""

from __future__ import annotations

from dgpp.engine.server.output_parser import OutputParser, ParsedDelta, merge
from dgpp.engine.server.state import ServerState
from dgpp.engine.server.tool_choice import HERMES_CLOSE, ForcedStart

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ResponseParser:
    """An `OutputParser` that has already read the forced opening, if any."""

    def __init__(
        self,
        state: ServerState,
        prompt: list[int],
        tools_enabled: bool,
        forced: ForcedStart | None = None,
    ) -> None:
        template = state.tokenizer.chat_template or ""
        reasoning = THINK_OPEN in template
        tail = state.tokenizer.decode(prompt[-4:]) if reasoning and forced is None else ""
        # The output starts inside a reasoning block the prompt opened (Qwen3 thinking on).
        self.starts_in_reasoning = tail.rstrip("\n").endswith(THINK_OPEN)
        self.parser = OutputParser(
            reasoning=reasoning,
            tools=tools_enabled or forced is not None,
            starts_in_reasoning=self.starts_in_reasoning,
        )
        self.forced = forced
        self._pending = self.parser.feed(forced.text) if forced is not None else ParsedDelta()

    @property
    def num_tool_calls(self) -> int:
        return self.parser.num_tool_calls

    def tool_calls(self) -> list[dict]:
        return self.parser.tool_calls()

    def feed(self, text: str) -> ParsedDelta:
        delta = merge([self._pending, self.parser.feed(text)])
        self._pending = ParsedDelta()
        return delta

    def finish(self, generated: str) -> ParsedDelta:
        """Flush at the end; closes a forced tool call the model left open."""
        pieces = [self._pending]
        if self.forced is not None and HERMES_CLOSE not in generated:
            pieces.append(self.parser.feed(self.forced.closing))
        pieces.append(self.parser.finish())
        self._pending = ParsedDelta()
        return merge(pieces)

    def parse_whole(self, generated: str) -> ParsedDelta:
        return merge([self.feed(generated), self.finish(generated)])
