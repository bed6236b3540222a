"""MiniMax-M2 XML tool calls (its chat template):

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    <invoke name="get_time">
    <parameter name="zone">CET</parameter>
    </invoke>
    </minimax:tool_call>

One `<minimax:tool_call>` block may hold several `<invoke>`s (parallel calls): each `<invoke>` is
a call, and the block's own tags are dropped from the content. A value is converted by the
parameter's schema type as the Qwen3-Coder format's are (tool_arguments.py): text where a string
is allowed or the schema does not say, else JSON; one newline just inside the tags is layout.
A missing `</parameter>` ends at the next `<parameter` or at the call's end. Reasoning is
`<think>…</think>`.
"""

from __future__ import annotations

import re
from functools import partial

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.parsers.tool_parser import ToolCallParser
from dgpp.engine.server.parsers.xml_parameters import invoke_call

BLOCK_OPEN = "<minimax:tool_call>"
BLOCK_CLOSE = "</minimax:tool_call>"
INVOKE_OPEN = "<invoke name="
INVOKE_CLOSE = "</invoke>"
_PARAMETER = re.compile(r"""\s*<parameter name=["']?([^"'<>]*?)["']?\s*>""")


def minimax_call(body: str, schemas: ToolSchemas) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of an `<invoke name=` body (up to its `</invoke>`), or None
    when it is not a call."""
    return invoke_call(body, schemas, _PARAMETER, "<parameter")


def minimax_parser(schemas: ToolSchemas) -> ToolCallParser:
    return ToolCallParser(
        partial(minimax_call, schemas=schemas),
        open_tag=INVOKE_OPEN,
        close_tag=INVOKE_CLOSE,
        llama_json=False,
        dropped=(BLOCK_OPEN, BLOCK_CLOSE),
        strip_after_dropped=True,
    )
