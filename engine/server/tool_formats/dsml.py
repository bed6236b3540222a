"""DeepSeek's DSML tool calls (DeepSeek-V3.2 brackets them in `function_calls`, DeepSeek-V4 in
`tool_calls`):

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

One block may hold several invokes (parallel calls), each a call; the block's tags are dropped
from the content. A parameter tagged `string="true"` is its text as written; `string="false"`
is JSON (a number, a boolean, an object...); without the attribute, or with JSON that does not
parse, the tool's schema types it as the other XML formats' values are (tool_arguments.py). One
newline just inside the tags is layout. Reasoning is `<think>…</think>`.
"""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas, convert_argument
from dgpp.engine.server.parsers.tool_parser import ToolCallParser
from dgpp.engine.server.parsers.xml_parameters import invoke_call

DSML = "｜DSML｜"
BLOCKS = (
    f"<{DSML}function_calls>",
    f"</{DSML}function_calls>",
    f"<{DSML}tool_calls>",
    f"</{DSML}tool_calls>",
)
INVOKE_OPEN = f"<{DSML}invoke name="
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_OPEN = f"<{DSML}parameter"
PARAMETER_CLOSE = f"</{DSML}parameter>"
_PARAMETER = re.compile(
    rf"""\s*{PARAMETER_OPEN} name=["']?([^"'<>]*?)["']?(?:\s+string=["']?(true|false)["']?)?\s*>"""
)


def _value(text: str, tag: re.Match[str], name: str, schemas: ToolSchemas) -> Any:
    """A parameter's value by its `string` flag, else by the schema."""
    flag, key = tag.group(2), tag.group(1).strip()
    if flag == "true":
        return text
    if flag == "false":
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            pass
    return convert_argument(text, schemas.types(name, key), untyped_json=flag == "false")


def dsml_call(body: str, schemas: ToolSchemas) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of an invoke's body (after `invoke name=`, up to its close), or
    None when it is not a call."""

    def convert_for(name: str) -> Any:
        return partial(_value, name=name, schemas=schemas)

    return invoke_call(body, schemas, _PARAMETER, PARAMETER_OPEN, PARAMETER_CLOSE, convert_for)


def dsml_parser(schemas: ToolSchemas) -> ToolCallParser:
    return ToolCallParser(
        partial(dsml_call, schemas=schemas),
        open_tag=INVOKE_OPEN,
        close_tag=INVOKE_CLOSE,
        llama_json=False,
        dropped=BLOCKS,
        strip_after_dropped=True,
    )
