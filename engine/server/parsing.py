"""Chooses the output parser for a request from the checkpoint's template and the prompt."""

from __future__ import annotations

from dgpp.engine.server.output_parser import OutputParser
from dgpp.engine.server.state import ServerState

THINK_OPEN = "<think>"


def make_parser(state: ServerState, prompt: list[int], tools_enabled: bool) -> OutputParser:
    """Reasoning is parsed when the chat template knows `<think>`; a prompt that already ends
    inside `<think>` (Qwen3 with thinking on) starts the output in reasoning."""
    template = state.tokenizer.chat_template or ""
    reasoning = THINK_OPEN in template
    tail = state.tokenizer.decode(prompt[-4:]) if reasoning else ""
    return OutputParser(
        reasoning=reasoning,
        tools=tools_enabled,
        starts_in_reasoning=tail.rstrip("\n").endswith(THINK_OPEN),
    )
