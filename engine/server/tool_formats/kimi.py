"""Kimi K2 tool calls (Kimi K2, Kimi-Linear). A run of calls is bracketed by
`<|tool_calls_section_begin|>` … `<|tool_calls_section_end|>`, each call by
`<|tool_call_begin|>` … `<|tool_call_end|>`:

    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}
    <|tool_call_end|>     (one line: wrapped here)

The call's id is what the model wrote before the arguments (`functions.NAME:INDEX`, the index
counting calls across the conversation) and is kept as the call's id, as vLLM's `kimi_k2` parser
keeps it: the chat template renders an assistant turn's calls and the tool results by that id,
so the model reads back the ids it wrote. The name is the id without its `functions.` prefix and
`:INDEX` suffix. The markers are special tokens: the output is decoded with them kept
(output_format.py). Reasoning (Kimi K2 Thinking) is `<think>…</think>`.
"""

from __future__ import annotations

import json
import re

from dgpp.engine.server.parsers.tool_parser import ToolCallParser

CALLS_BEGIN = "<|tool_calls_section_begin|>"
CALLS_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
CALL_END = "<|tool_call_end|>"
ARGUMENTS = "<|tool_call_argument_begin|>"
_ID = re.compile(r"(?:functions\.)?([^\s:<>]+)(?::\d+)?")


def kimi_call(body: str) -> tuple[str, str, str] | None:
    """`(name, arguments JSON, id)` of a call body (between the call markers), or None."""
    head, separator, rest = body.partition(ARGUMENTS)
    call_id = head.strip()
    found = _ID.fullmatch(call_id)
    if not separator or found is None:
        return None
    try:
        arguments = json.loads(rest)
    except (ValueError, RecursionError):
        return None
    if not isinstance(arguments, dict):
        return None
    return found.group(1), json.dumps(arguments, ensure_ascii=False), call_id


def kimi_parser() -> ToolCallParser:
    return ToolCallParser(
        kimi_call,
        open_tag=CALL_BEGIN,
        close_tag=CALL_END,
        llama_json=False,
        dropped=(CALLS_BEGIN, CALLS_END),
    )
