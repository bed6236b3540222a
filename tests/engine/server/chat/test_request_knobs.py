"""How request fields map onto the chat template and the history: reasoning efforts and
thinking types of every API, Claude's clear-thinking edits, and the Qwen3-style template that
switches reasoning with `enable_thinking` (rendered for real)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.server.anthropic.convert import clear_thinking, to_chat_messages
from dgpp.engine.server.anthropic.protocol import CountTokensRequest
from dgpp.engine.server.chat.reasoning_knobs import reasoning_kwargs, template_kwargs
from dgpp.engine.server.chat.render import normalise, probe_template, render
from dgpp.engine.server.openai.protocol import ChatMessage

THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@pytest.mark.parametrize(
    ("effort", "thinking", "expected"),
    [
        (None, None, {}),
        ("none", None, {"reasoning_effort": "low", "enable_thinking": False}),
        ("minimal", None, {"reasoning_effort": "low", "enable_thinking": False}),
        ("medium", None, {"reasoning_effort": "medium", "enable_thinking": True}),
        ("xhigh", None, {"reasoning_effort": "high", "enable_thinking": True}),
        ("max", None, {"reasoning_effort": "high", "enable_thinking": True}),
        (None, "disabled", {"enable_thinking": False}),
        (None, "adaptive", {"enable_thinking": True}),
        ("minimal", "enabled", {"reasoning_effort": "low", "enable_thinking": True}),
    ],
)
def test_efforts_and_thinking_types_become_template_arguments(
    effort: str | None, thinking: str | None, expected: dict[str, Any]
) -> None:
    assert reasoning_kwargs(effort, thinking) == expected


def test_explicit_template_arguments_win() -> None:
    kwargs = template_kwargs(
        {"enable_thinking": True, "x": 1}, effort="none", explicit={"enable_thinking": True}
    )
    assert kwargs == {"enable_thinking": True, "x": 1, "reasoning_effort": "low"}


def test_a_disabled_thinking_request_renders_the_empty_think_block(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = THINKING_TEMPLATE
    messages = normalise([ChatMessage(role="user", content="hi")], probe_template(tokenizer))
    off = render(tokenizer, messages, None, reasoning_kwargs(thinking="disabled"), True)
    on = render(tokenizer, messages, None, reasoning_kwargs(effort="high"), True)
    assert tokenizer.decode(off).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in tokenizer.decode(on)


def _history(turns: int) -> CountTokensRequest:
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"q{turn}"})
        thought = {"type": "thinking", "thinking": f"t{turn}", "signature": "s"}
        messages.append({"role": "assistant", "content": [thought, {"type": "text", "text": "a"}]})
    messages.append({"role": "user", "content": "next"})
    return CountTokensRequest.model_validate({"model": "m", "messages": messages})


def _reasoning(messages: list[ChatMessage]) -> list[str | None]:
    return [m.reasoning_content for m in messages if m.role == "assistant"]


@pytest.mark.parametrize(
    ("keep", "expected"),
    [
        ("all", ["t0", "t1", "t2"]),
        ({"type": "thinking_turns", "value": 2}, [None, "t1", "t2"]),
        ({"type": "thinking_turns", "value": 0}, [None, None, None]),
        (None, [None, None, "t2"]),  # no `keep`: the last thinking turn's
    ],
)
def test_clear_thinking_keeps_the_last_turns(keep: Any, expected: list[str | None]) -> None:
    request = _history(3)
    edit: dict[str, Any] = {"type": "clear_thinking_20251015"}
    if keep is not None:
        edit["keep"] = keep
    request.context_management = {"edits": [edit]}
    assert _reasoning(to_chat_messages(request)) == expected


def test_other_context_edits_leave_the_history_alone() -> None:
    messages = to_chat_messages(_history(2))
    management = {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"value": 0}}]}
    assert clear_thinking(messages, management) == messages


def test_a_malformed_keep_is_refused() -> None:
    management = {"edits": [{"type": "clear_thinking_20251015", "keep": {"value": "two"}}]}
    with pytest.raises(InvalidRequestError, match="keep"):
        clear_thinking(to_chat_messages(_history(1)), management)


def test_a_system_turn_inside_messages_keeps_its_place() -> None:
    request = CountTokensRequest.model_validate(
        {
            "model": "m",
            "system": "top",
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "system", "content": [{"type": "text", "text": "later rule"}]},
                {"role": "user", "content": "b"},
            ],
        }
    )
    messages = to_chat_messages(request)
    assert [(m.role, m.content) for m in messages] == [
        ("system", "top"),
        ("user", "a"),
        ("system", "later rule"),
        ("user", "b"),
    ]
