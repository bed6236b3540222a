"""GLM-4.5/4.6 tool calls (Glm4MoeForCausalLM), as the model's chat template writes them:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name ends at the first newline (or at the first `<arg_key>`, as GLM-4.7 writes it); a call
without arguments is just `<tool_call>NAME</tool_call>`. Values are text; the template renders a
non-string argument with `tojson`, so a value is read back as JSON unless the tool's schema allows
a string there (tool_arguments.py). A body that starts with "{" is read as Hermes JSON, which is
what a forced tool choice makes the model write (tool_choice.py). Reasoning is `<think>…</think>`.
"""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas, convert_argument
from dgpp.engine.server.parsers.tool_parser import ToolCallParser, hermes_call

ARG_KEY_OPEN = "<arg_key>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[^\s<>]+")


def glm_call(body: str, schemas: ToolSchemas) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of a block body, or None when it is not a GLM call."""
    if body.lstrip().startswith("{"):
        return hermes_call(body)
    ends = [at for at in (body.find("\n"), body.find(ARG_KEY_OPEN)) if at >= 0]
    cut = min(ends, default=len(body))
    name = body[:cut].strip()
    if not _NAME.fullmatch(name):
        return None
    arguments: dict[str, Any] = {}
    pos = cut
    while (pair := _PAIR.match(body, pos)) is not None:
        key = pair.group(1).strip()
        if not key:
            return None
        types = schemas.types(name, key)
        arguments[key] = convert_argument(pair.group(2), types, untyped_json=True)
        pos = pair.end()
    if body[pos:].strip():
        return None  # text that is not an argument pair: not a call
    return name, json.dumps(arguments, ensure_ascii=False)


def glm_parser(schemas: ToolSchemas) -> ToolCallParser:
    return ToolCallParser(partial(glm_call, schemas=schemas), llama_json=False)
