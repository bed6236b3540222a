"""Which tool-call and reasoning format a served model writes, chosen once per model.

`ServerConfig.tool_call_parser` names it, or is "auto" (the default): the checkpoint's chat
template shows it, as the template is what teaches the model to write its calls:

| format        | chosen by "auto" when the template contains | families                        |
| ------------- | ------------------------------------------- | ------------------------------- |
| `harmony`     | `<|channel|>`                               | gpt-oss                         |
| `deepseek_v3` | `<｜tool▁calls▁begin｜>`                    | DeepSeek-V3, V3.1, R1           |
| `glm45`       | `<arg_key>`                                 | GLM-4.5, GLM-4.6                |
| `qwen3_coder` | `<function=` and `<parameter=`              | Qwen3-Coder, Qwen3-Next, MiMo   |
| `minimax_m2`  | `<minimax:tool_call>`                       | MiniMax-M2                      |
| `kimi_k2`     | `<|tool_calls_section_begin|>`              | Kimi K2, Kimi-Linear            |
| `dsml`        | `｜DSML｜`                                    | DeepSeek-V3.2, DeepSeek-V4      |
| `hermes`      | none of those                               | Hermes/Qwen `<tool_call>` JSON, |
|               |                                             | Llama 3 JSON (as before)        |

The harmony, DeepSeek (both forms), GLM and Kimi markers are (or may be, by tokenizer version)
special tokens, which the engine drops when it decodes with `skip_special_tokens` (vLLM turns
that off for the same parsers). For those formats the output is decoded with special tokens kept
and the parser strips every special token it did not consume from what the client sees
(special_tokens.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from dgpp.engine.server.parsers.special_tokens import SpecialTokenText
from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.parsers.tool_parser import ToolCallParser
from dgpp.engine.server.tool_formats.deepseek import CALLS_BEGIN, deepseek_parser
from dgpp.engine.server.tool_formats.dsml import DSML, dsml_parser
from dgpp.engine.server.tool_formats.glm import ARG_KEY_OPEN, glm_parser
from dgpp.engine.server.tool_formats.harmony import CHANNEL
from dgpp.engine.server.tool_formats.kimi import CALLS_BEGIN as KIMI_CALLS
from dgpp.engine.server.tool_formats.kimi import kimi_parser
from dgpp.engine.server.tool_formats.minimax import BLOCK_OPEN, minimax_parser
from dgpp.engine.server.tool_formats.qwen_xml import FUNCTION_OPEN, PARAMETER_OPEN, qwen_xml_parser

log = logging.getLogger(__name__)

AUTO = "auto"


class ToolFormat(StrEnum):
    HERMES = "hermes"
    GLM45 = "glm45"
    DEEPSEEK_V3 = "deepseek_v3"
    HARMONY = "harmony"
    QWEN3_CODER = "qwen3_coder"
    MINIMAX_M2 = "minimax_m2"
    KIMI_K2 = "kimi_k2"
    DSML = "dsml"


SETTINGS = (AUTO, *(kind.value for kind in ToolFormat))
KEEPS_SPECIAL_TOKENS = frozenset(
    {
        ToolFormat.GLM45,
        ToolFormat.DEEPSEEK_V3,
        ToolFormat.HARMONY,
        ToolFormat.KIMI_K2,
        ToolFormat.DSML,
    }
)


def detect_format(chat_template: str) -> ToolFormat:
    """The format a chat template teaches; the first rule that matches wins."""
    if CHANNEL in chat_template:
        return ToolFormat.HARMONY
    if DSML in chat_template:
        return ToolFormat.DSML
    if CALLS_BEGIN in chat_template:
        return ToolFormat.DEEPSEEK_V3
    if KIMI_CALLS in chat_template:
        return ToolFormat.KIMI_K2
    if ARG_KEY_OPEN in chat_template:
        return ToolFormat.GLM45
    if BLOCK_OPEN in chat_template:
        return ToolFormat.MINIMAX_M2
    if FUNCTION_OPEN in chat_template and PARAMETER_OPEN in chat_template:
        return ToolFormat.QWEN3_CODER
    return ToolFormat.HERMES


def template_text(tokenizer: Any) -> str:
    """The chat template as text; a tokenizer with named templates has them all searched."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        return "\n".join(str(text) for text in template.values())
    return str(template)


@dataclass(frozen=True)
class OutputFormat:
    """A served model's format. `special_tokens` is set where the output is decoded with
    special tokens kept (and they are stripped again after parsing)."""

    tool_format: ToolFormat = ToolFormat.HERMES
    special_tokens: SpecialTokenText | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        return self.special_tokens is not None


def choose_output_format(setting: str, tokenizer: Any) -> OutputFormat:
    """The format for `ServerConfig.tool_call_parser`: one of `SETTINGS`."""
    if setting not in SETTINGS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(SETTINGS)}, got {setting!r}")
    kind = detect_format(template_text(tokenizer)) if setting == AUTO else ToolFormat(setting)
    log.info("tool-call format: %s%s", kind.value, " (from the chat template)" * (setting == AUTO))
    if kind not in KEEPS_SPECIAL_TOKENS:
        return OutputFormat(kind)
    return OutputFormat(kind, SpecialTokenText.of(tokenizer))


def content_tool_parser(kind: ToolFormat, schemas: ToolSchemas) -> ToolCallParser:
    """The parser of tool calls in the content (after reasoning is split off) for the formats
    that write calls as tagged blocks; harmony has its own whole-output parser."""
    if kind is ToolFormat.GLM45:
        return glm_parser(schemas)
    if kind is ToolFormat.DEEPSEEK_V3:
        return deepseek_parser()
    if kind is ToolFormat.QWEN3_CODER:
        return qwen_xml_parser(schemas)
    if kind is ToolFormat.MINIMAX_M2:
        return minimax_parser(schemas)
    if kind is ToolFormat.KIMI_K2:
        return kimi_parser()
    if kind is ToolFormat.DSML:
        return dsml_parser(schemas)
    if kind is ToolFormat.HARMONY:
        raise ValueError("harmony output is parsed whole by HarmonyParser")
    return ToolCallParser()
