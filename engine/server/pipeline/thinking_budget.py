"""One reasoning budget per request from what each API says (`engine.sampling.reasoning_budget`
does the forcing): Anthropic's `thinking.budget_tokens`, else OpenAI's `reasoning_effort` /
Responses' `reasoning.effort` / Anthropic's `output_config.effort`, else the deployment's
`http.default_reasoning_effort`, as a number of tokens (`EFFORT_TOKENS`).

Whatever was asked, reasoning may take at most `max_tokens` less a quarter of it (at least one
token), so the answer always has room: an agent never gets an empty answer because thinking ate
`max_tokens`. Past the budget the engine writes the family's own close: `</think>` where the
template knows `<think>` (opened by the prompt, or by the output itself), and gpt-oss's
`<|end|><|start|>assistant<|channel|>final<|message|>` in harmony. A request whose output a
grammar constrains gets no budget (the grammar decides its tokens), nor does a format without
reasoning. The effort also still reaches the chat template as its own kwarg
(`reasoning_knobs`), where the template has one.
"""

from __future__ import annotations

from typing import Any

from dgpp.engine.server.pipeline.response_parser import THINK_CLOSE, THINK_OPEN, ResponseParser
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.tool_formats.output_format import ToolFormat

# Reasoning tokens per effort (None: as many as `max_tokens` leaves room for)
EFFORT_TOKENS: dict[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": 32768,
    "max": None,
}
ANSWER_SHARE = 4  # 1/4 of max_tokens is kept for the answer
HARMONY_OPEN = "<|channel|>analysis<|message|>"
HARMONY_END = "<|end|><|start|>assistant<|channel|>final<|message|>"
HARMONY_CLOSE = "<|end|>"


def reasoning_cap(max_tokens: int) -> int:
    """The most reasoning tokens a request of `max_tokens` may spend."""
    return max_tokens - max(1, max_tokens // ANSWER_SHARE)


def _ids(state: ServerState, text: str) -> tuple[int, ...]:
    return tuple(state.tokenizer(text, add_special_tokens=False).input_ids)


def markers(
    state: ServerState, parser: ResponseParser
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(the ids that open the block, that close it when forced, the model's own shorter close)
    of the served format; None where the output has no reasoning block dgpp parses."""
    if state.output_format.tool_format is ToolFormat.HARMONY:
        return _ids(state, HARMONY_OPEN), _ids(state, HARMONY_END), _ids(state, HARMONY_CLOSE)
    if THINK_OPEN not in (state.tokenizer.chat_template or ""):
        return None
    opens = () if parser.starts_in_reasoning else _ids(state, THINK_OPEN)
    return opens, _ids(state, THINK_CLOSE), ()


def budget_params(
    state: ServerState,
    parser: ResponseParser,
    grammar: str | None,
    max_tokens: int,
    effort: str | None = None,
    budget_tokens: int | None = None,
) -> dict[str, Any]:
    """The `SamplingParams` fields of the request's reasoning budget (none: {})."""
    if grammar is not None or parser.forced is not None:
        return {}
    found = markers(state, parser)
    if found is None:
        return {}
    opens, end, close = found
    cap = reasoning_cap(max_tokens)
    requested = budget_tokens
    if requested is None:
        requested = EFFORT_TOKENS.get(effort or state.config.default_reasoning_effort or "")
    budget = cap if requested is None else min(requested, cap)
    return {
        "reasoning_budget": max(0, budget),
        "reasoning_end": end,
        "reasoning_open": opens,
        "reasoning_close": close,
    }
