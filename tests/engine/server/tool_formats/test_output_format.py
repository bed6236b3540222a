"""How a served model's tool-call format is chosen, and what it changes in decoding."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.server.pipeline.response_parser import decoding_params
from dgpp.engine.server.tool_formats.output_format import (
    SETTINGS,
    ToolFormat,
    choose_output_format,
    detect_format,
    template_text,
)

# The telling parts of each family's chat template.
GLM_TEMPLATE = (
    "<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>"
)
DEEPSEEK_TEMPLATE = "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name}}"
HARMONY_TEMPLATE = "{{- '<|start|>assistant<|channel|>final<|message|>' }}"
QWEN_CODER_TEMPLATE = "<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>\n{{ value }}"
HERMES_TEMPLATE = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'


@pytest.mark.parametrize(
    ("template", "kind"),
    [
        (GLM_TEMPLATE, ToolFormat.GLM45),
        (DEEPSEEK_TEMPLATE, ToolFormat.DEEPSEEK_V3),
        (HARMONY_TEMPLATE, ToolFormat.HARMONY),
        (QWEN_CODER_TEMPLATE, ToolFormat.QWEN3_CODER),
        (HERMES_TEMPLATE, ToolFormat.HERMES),
        ("<function=f> without parameters", ToolFormat.HERMES),
        ("", ToolFormat.HERMES),
    ],
)
def test_detect_format(template: str, kind: ToolFormat) -> None:
    assert detect_format(template) is kind


def tokenizer_with(template: Any, special: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(chat_template=template, all_special_tokens=list(special))


def test_auto_follows_the_template_and_a_setting_overrides_it() -> None:
    harmony = tokenizer_with(HARMONY_TEMPLATE, ("<|channel|>", "<|endoftext|>"))
    chosen = choose_output_format("auto", harmony)
    assert chosen.tool_format is ToolFormat.HARMONY and chosen.keeps_special_tokens
    assert chosen.special_tokens is not None and "<|endoftext|>" in chosen.special_tokens.texts
    forced = choose_output_format("hermes", harmony)
    assert forced.tool_format is ToolFormat.HERMES and not forced.keeps_special_tokens
    assert choose_output_format("glm45", tokenizer_with(None)).tool_format is ToolFormat.GLM45


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_setting_is_accepted(setting: str) -> None:
    chosen = choose_output_format(setting, tokenizer_with(HERMES_TEMPLATE))
    special = (
        ToolFormat.GLM45,
        ToolFormat.DEEPSEEK_V3,
        ToolFormat.HARMONY,
        ToolFormat.KIMI_K2,
        ToolFormat.DSML,
    )
    keeps = chosen.tool_format in special
    assert chosen.keeps_special_tokens == keeps


def test_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="tool_call_parser"):
        choose_output_format("mistral", tokenizer_with(""))


def test_named_templates_are_all_searched() -> None:
    named = {"default": "plain", "tool_use": GLM_TEMPLATE}
    assert detect_format(template_text(tokenizer_with(named))) is ToolFormat.GLM45


def test_the_default_model_keeps_todays_format(tokenizer: Any) -> None:
    assert choose_output_format("auto", tokenizer).tool_format is ToolFormat.HERMES


def test_decoding_keeps_special_tokens_only_where_the_format_needs_them() -> None:
    params = SamplingParams(max_tokens=4)
    for template, keeps in ((HARMONY_TEMPLATE, True), (HERMES_TEMPLATE, False)):
        state = SimpleNamespace(
            output_format=choose_output_format("auto", tokenizer_with(template))
        )
        decoded = decoding_params(state, params)  # type: ignore[arg-type]
        assert decoded.skip_special_tokens is not keeps
        assert decoded.max_tokens == 4


def test_the_knob_flows_from_the_deployment_and_the_cli() -> None:
    from typing import get_args

    from dgpp.appliance.cli import build_parser
    from dgpp.appliance.commands.serve import serve_deployment
    from dgpp.appliance.deployments.deployment import HttpSection, parse_deployment, server_config

    annotation = HttpSection.model_fields["tool_call_parser"].annotation
    assert get_args(annotation) == SETTINGS  # the schema offers exactly what the server knows
    assert server_config(parse_deployment({"model": "m"})).tool_call_parser == "auto"
    named = parse_deployment({"model": "m", "http": {"tool_call_parser": "glm45"}})
    assert server_config(named).tool_call_parser == "glm45"
    args = build_parser().parse_args(["serve", "--tool-call-parser", "harmony"])
    assert server_config(serve_deployment(args)).tool_call_parser == "harmony"
