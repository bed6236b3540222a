"""Qwen3-Coder XML tool calls (the Qwen3-Coder and Qwen3-Next-style chat templates):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The template writes each value between a newline after `<parameter=K>` and one before
`</parameter>`; those two newlines are layout and dropped, any other whitespace is the value's.
A value is converted by the parameter's schema type (tool_arguments.py): text where a string is
allowed or the schema does not say, else JSON, `True`/`False`, `None`. A missing `</parameter>`
ends at the next `<parameter=` or at `</function>`; a missing `</function>` at the block's end.
A body that starts with "{" is read as Hermes JSON (what a forced tool choice makes the model
write, tool_choice.py). Reasoning, where the template has it, is `<think>…</think>`.
"""

from __future__ import annotations

import json
import re
from functools import partial

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.parsers.tool_parser import ToolCallParser, hermes_call
from dgpp.engine.server.parsers.xml_parameters import read_parameters

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
_HEAD = re.compile(r"\s*<function=([^\s<>]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^<>]*?)>")


def qwen_xml_call(body: str, schemas: ToolSchemas) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of a block body, or None when it is not a call."""
    if body.lstrip().startswith("{"):
        return hermes_call(body)
    head = _HEAD.match(body)
    if head is None:
        return None
    name = head.group(1)
    end = body.find(FUNCTION_CLOSE, head.end())
    if end < 0:
        end = len(body)
    elif body[end + len(FUNCTION_CLOSE) :].strip():
        return None  # text after the function: not a call
    region = body[:end]
    found = read_parameters(region, head.end(), _PARAMETER, PARAMETER_OPEN, name, schemas)
    if found is None:
        return None
    arguments, pos = found
    if region[pos:].strip():
        return None  # text that is not a parameter: not a call
    return name, json.dumps(arguments, ensure_ascii=False)


def qwen_xml_parser(schemas: ToolSchemas) -> ToolCallParser:
    return ToolCallParser(partial(qwen_xml_call, schemas=schemas), llama_json=False)
