"""DeepSeek-V3 / V3.1 tool calls (DeepseekV3ForCausalLM). A run of calls is bracketed by
`<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>`, each call by `<｜tool▁call▁begin｜>` …
`<｜tool▁call▁end｜>`, in one of two forms:

    V3:   <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
          ```json
          {"city": "Paris"}
          ```<｜tool▁call▁end｜>
    V3.1: <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>

The form is told per call from its body: a fenced JSON block after a name line is V3, anything
else is V3.1's name before the separator and JSON after it. The brackets around a run are dropped
from the content. The output is decoded with special tokens kept, so that markers the tokenizer
marks special reach the parser (output_format.py). Reasoning (V3.1, R1) is `<think>…</think>`.
"""

from __future__ import annotations

import json
import re

from dgpp.engine.server.parsers.tool_parser import ToolCallParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEPARATOR = "<｜tool▁sep｜>"
# V3's body after the separator: the name on its own line, then the arguments in a fenced block.
_FENCED = re.compile(r"\s*([^\s`]+)[ \t]*\n```(?:json)?[ \t]*\n(.*?)\n?```\s*", re.DOTALL)
_NAME = re.compile(r"[^\s<>]+")


def _arguments(text: str) -> str | None:
    """The JSON text of an arguments object, or None when `text` is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def deepseek_call(body: str) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of a call body (between the call markers), or None."""
    head, separator, rest = body.partition(SEPARATOR)
    if not separator:
        return None
    fenced = _FENCED.fullmatch(rest)
    if fenced is not None and head.strip() == "function":
        name, arguments = fenced.group(1), _arguments(fenced.group(2))
    else:
        name, arguments = head.strip(), _arguments(rest)
    if arguments is None or not _NAME.fullmatch(name):
        return None
    return name, arguments


def deepseek_parser() -> ToolCallParser:
    return ToolCallParser(
        deepseek_call,
        open_tag=CALL_BEGIN,
        close_tag=CALL_END,
        llama_json=False,
        dropped=(CALLS_BEGIN, CALLS_END),
    )
