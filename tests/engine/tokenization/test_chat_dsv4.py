"""DeepSeek-V4's chat encoding (its release ships no Jinja template): exact prompts for chat and
thinking turns, tools and their results, the tokenizer it is attached to, and a chat served
through it end to end whose tool call comes back parsed from DSML. The expected strings were
checked against the release's own `encoding_dsv4.py` (48 conversation/tool/thinking/effort
combinations, equal) when this was written; that file is not vendored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dgpp.engine.server.tool_formats.output_format import ToolFormat, detect_format, template_text
from dgpp.engine.tokenization.chat_dsv4 import EFFORT, TOOLS, attach, encode

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b", "reasoning_content": "r"},
    {"role": "user", "content": "c"},
]


def _call(call_id: str, **arguments: object) -> dict[str, object]:
    function = {"name": "get_weather", "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}


def test_chat_and_thinking_turns() -> None:
    """Chat: every answer closed at once; thinking: the answered turn opens `<think>`, an
    earlier answer's reasoning is dropped; `reasoning_effort: max` leads the prompt."""
    history = f"{B}Be brief.{U}a{A}</think>b{E}{U}c{A}"
    assert encode(HISTORY) == history + "</think>"
    assert encode(HISTORY, thinking=True) == history + "<think>"
    effort = encode(HISTORY, thinking=True, reasoning_effort="max")
    assert effort == B + EFFORT["max"] + history.removeprefix(B) + "<think>"
    assert encode(HISTORY[:2], add_generation_prompt=False) == f"{B}Be brief.{U}a"


def test_tools_calls_and_results() -> None:
    """Tools follow the system prompt (an empty one made); calls are DSML invokes with typed
    parameters; results join one user turn in the calls' order; with tools, every answer
    keeps its reasoning."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need it",
            "tool_calls": [_call("1", city="Paris", days=3), _call("2", city="Rome")],
        },
        {"role": "tool", "tool_call_id": "2", "content": "rain"},
        {"role": "tool", "tool_call_id": "1", "content": "sun"},
    ]
    tools = TOOLS.replace("{schemas}", json.dumps(WEATHER["function"]))
    calls = (
        f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n'
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Rome</{D}parameter>\n</{D}invoke>\n'
        f"</{D}tool_calls>"
    )
    results = f"{U}<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>{A}"
    want = f"{B}\n\n{tools}{U}Weather?{A}<think>need it</think>{calls}{E}{results}<think>"
    assert encode(messages, [WEATHER], thinking=True) == want


@pytest.fixture(scope="module")
def bare_tokenizer(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test tokenizer without a chat template, as DeepSeek-V4's release ships."""
    out = tmp_path_factory.mktemp("bare-tokenizer")
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def test_attached_to_a_tokenizer_without_a_template(bare_tokenizer: Path) -> None:
    tokenizer = attach(AutoTokenizer.from_pretrained(str(bare_tokenizer)))
    assert detect_format(template_text(tokenizer)) is ToolFormat.DSML
    text = tokenizer.apply_chat_template(
        HISTORY, tokenize=False, add_generation_prompt=True, thinking=True
    )
    assert text == encode(HISTORY, thinking=True)
    ids = tokenizer.apply_chat_template(HISTORY, add_generation_prompt=True, thinking=True)
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    kept = AutoTokenizer.from_pretrained(str(bare_tokenizer))
    kept.chat_template = "{{ messages[0].content }}"
    assert attach(kept).chat_template == "{{ messages[0].content }}"  # its own template wins


def test_a_deepseek_v4_checkpoint_serves_chats_through_it(
    bare_tokenizer: Path, tmp_path: Path
) -> None:
    """`dgpp serve`'s path on a tiny DeepSeek-V4 without a template: the prompt is this
    encoding (its token count), thinking on at the request's word, tools in the DSML format."""
    import httpx

    from tests.conftest import build_tiny_checkpoint
    from tests.engine.models.test_deepseek_v4 import TINY
    from tests.engine.server.harness import running_server

    checkpoint = build_tiny_checkpoint(tmp_path, bare_tokenizer, "DeepseekV4ForCausalLM", **TINY)
    tokenizer = attach(AutoTokenizer.from_pretrained(str(bare_tokenizer)))
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with running_server(checkpoint, ("m",), {"block_size": 4, "kv_capacity": 1024}) as server:
        assert server.state.output_format.tool_format is ToolFormat.DSML
        body = {
            "model": "m",
            "messages": messages,
            "tools": [WEATHER],
            "max_tokens": 3,
            "chat_template_kwargs": {"thinking": True},
        }
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    prompt = encode(messages, [WEATHER], thinking=True)
    assert prompt.endswith("<｜Assistant｜><think>")
    want = len(tokenizer(prompt, add_special_tokens=False).input_ids)
    assert reply.json()["usage"]["prompt_tokens"] == want
