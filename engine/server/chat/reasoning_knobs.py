"""What the request says about reasoning, as chat-template arguments.

Each API spells it differently: OpenAI `reasoning_effort` (Chat Completions) and
`reasoning.effort` (Responses), Anthropic `thinking` and `output_config.effort`. Templates that
switch reasoning read `enable_thinking` (Qwen3, GLM, DeepSeek-V3.1) or `reasoning_effort`
(gpt-oss: low / medium / high); a template without either ignores both.
"""

from __future__ import annotations

from typing import Any

# Efforts that ask for (almost) no reasoning: templates that can switch it off do.
NO_REASONING = frozenset({"none", "minimal"})
TEMPLATE_EFFORT = {
    "none": "low",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}


def reasoning_kwargs(effort: str | None = None, thinking: str | None = None) -> dict[str, Any]:
    """Template arguments for an effort and an Anthropic thinking type (enabled, adaptive,
    disabled); an explicit thinking type decides `enable_thinking`, else the effort does."""
    kwargs: dict[str, Any] = {}
    if effort is not None:
        kwargs["reasoning_effort"] = TEMPLATE_EFFORT[effort]
        kwargs["enable_thinking"] = effort not in NO_REASONING
    if thinking is not None:
        kwargs["enable_thinking"] = thinking != "disabled"
    return kwargs


def template_kwargs(
    defaults: dict[str, Any],
    effort: str | None = None,
    thinking: str | None = None,
    explicit: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The server's default template arguments, then the request's reasoning settings, then
    the request's own `chat_template_kwargs` (which win)."""
    kwargs = dict(defaults)
    kwargs.update(reasoning_kwargs(effort, thinking))
    kwargs.update(explicit or {})
    return kwargs
