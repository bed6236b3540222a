"""Chat normalisation against real templates: SmolLM2's, and a Qwen3-style template that allows
only one system message, at the beginning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.server.chat.render import TemplateTraits, normalise, probe_template, render
from dgpp.engine.server.openai.protocol import ChatMessage

QWEN3_STYLE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}"
    "{%- elif message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def smol(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def qwen_style(tokenizer_dir: Path) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = QWEN3_STYLE
    return tokenizer


def _messages(*pairs: tuple[str, Any]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]


def test_probe_finds_what_each_template_accepts(smol: Any, qwen_style: Any) -> None:
    assert probe_template(smol).multiple_leading_system
    assert probe_template(smol).late_system
    traits = probe_template(qwen_style)
    assert not traits.multiple_leading_system and not traits.late_system


def test_leading_instructions_merge_only_where_the_template_needs_it(
    smol: Any, qwen_style: Any
) -> None:
    messages = _messages(("developer", "Rule A."), ("system", "Rule B."), ("user", "Hi"))
    strict = normalise(messages, probe_template(qwen_style))
    assert strict[0] == {"role": "system", "content": "Rule A.\n\nRule B."}
    assert [m["role"] for m in strict] == ["system", "user"]
    lenient = normalise(messages, probe_template(smol))
    assert [m["role"] for m in lenient] == ["system", "system", "user"]
    # The rendered prompt is accepted by the strict template (no template error).
    render(qwen_style, strict, None, {}, True)


def test_late_system_message_becomes_a_user_turn_in_place(qwen_style: Any) -> None:
    traits = probe_template(qwen_style)
    messages = _messages(
        ("system", "You are helpful."),
        ("user", "one"),
        ("assistant", "two"),
        ("system", "<session-hook>context</session-hook>"),
        ("user", "three"),
    )
    out = normalise(messages, traits)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert out[3]["content"] == "<session-hook>context</session-hook>"
    assert out[0]["content"] == "You are helpful."  # never hoisted into the first message


@pytest.mark.parametrize("template", ["smol", "qwen_style"])
def test_turn_n_prompt_is_a_prefix_of_turn_n_plus_1(
    template: str, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(template)
    traits = probe_template(tokenizer)
    history = [("system", "You are a coding agent."), ("user", "Fix the bug in main.py")]
    reply = "I will read main.py first."
    turn_n = render(tokenizer, normalise(_messages(*history), traits), None, {}, True)
    later = [
        *history,
        ("assistant", reply),
        ("system", "Hook context: " + "x" * 2000),  # a late, large system message
        ("user", "Now run the tests."),
    ]
    turn_n1 = render(tokenizer, normalise(_messages(*later), traits), None, {}, True)
    assert turn_n1[: len(turn_n)] == turn_n


def test_anthropic_thinking_parts_become_reasoning_history() -> None:
    thinking = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Let me think.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Answer."},
            ],
        }
    )
    out = normalise([ChatMessage(role="user", content="q"), thinking], _lenient())
    assert out[1] == {
        "role": "assistant",
        "content": "Answer.",
        "reasoning_content": "Let me think.",
    }
    explicit = thinking.model_copy(update={"reasoning_content": "Explicit wins."})
    out = normalise([ChatMessage(role="user", content="q"), explicit], _lenient())
    assert out[1]["reasoning_content"] == "Explicit wins."


def test_unsupported_content_part_is_a_clear_error() -> None:
    message = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    )
    with pytest.raises(InvalidRequestError, match="image_url"):
        normalise([message], _lenient())


def test_tool_call_arguments_reach_the_template_as_objects() -> None:
    message = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"path": "/tmp"}'},
                }
            ],
        }
    )
    out = normalise([ChatMessage(role="user", content="q"), message], _lenient())
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"path": "/tmp"}


def _lenient() -> TemplateTraits:
    return TemplateTraits(multiple_leading_system=True, late_system=True)
