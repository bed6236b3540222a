"""The parameters of an XML-style tool call (Qwen3-Coder's `<parameter=K>V</parameter>`,
MiniMax-M2's `<parameter name="K">V</parameter>`, DeepSeek's DSML), each value typed by the
tool's schema (or, DSML, by the tag's own `string` attribute)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas, convert_argument

PARAMETER_CLOSE = "</parameter>"


# A value's conversion from its text, given the opening tag's match (DSML: its `string` flag),
# or None for the schema's.
Convert = Callable[[str, re.Match[str]], Any]


def read_parameters(
    region: str,
    pos: int,
    opener: re.Pattern[str],
    next_open: str,
    name: str,
    schemas: ToolSchemas,
    close_tag: str = PARAMETER_CLOSE,
    convert: Convert | None = None,
) -> tuple[dict[str, Any], int] | None:
    """`(arguments, end)` of the parameters of call `name` from `pos` in `region`, `opener`
    matching each one's opening tag (its key the first group) and `next_open` the start of any
    opening tag; None for an empty key. A missing `close_tag` ends at the next opening tag or
    at the region's end; one newline just inside the tags is layout and dropped."""
    arguments: dict[str, Any] = {}
    while (parameter := opener.match(region, pos)) is not None:
        key = parameter.group(1).strip()
        if not key:
            return None
        start = parameter.end()
        close = region.find(close_tag, start)
        following = region.find(next_open, start)
        if close < 0 or 0 <= following < close:  # unclosed: up to the next parameter or the end
            stop = following if following >= 0 else len(region)
            pos = stop
        else:
            stop = close
            pos = close + len(close_tag)
        value = region[start:stop].removeprefix("\n").removesuffix("\n")
        if convert is not None:
            arguments[key] = convert(value, parameter)
        else:
            arguments[key] = convert_argument(value, schemas.types(name, key), untyped_json=False)
    return arguments, pos


_INVOKE_NAME = re.compile(r"""\s*["']?([^"'<>\s]+)["']?\s*>""")


def invoke_call(
    body: str,
    schemas: ToolSchemas,
    opener: re.Pattern[str],
    next_open: str,
    close_tag: str = PARAMETER_CLOSE,
    convert_for: Callable[[str], Convert] | None = None,
) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of an `<invoke name="NAME">` body (after `name=`, up to the
    invoke's close) of parameters (MiniMax-M2, DSML), or None when it is not a call.
    `convert_for(name)`: how that tool's values are read (else by its schema)."""
    head = _INVOKE_NAME.match(body)
    if head is None:
        return None
    name = head.group(1)
    convert = convert_for(name) if convert_for is not None else None
    found = read_parameters(body, head.end(), opener, next_open, name, schemas, close_tag, convert)
    if found is None:
        return None
    arguments, pos = found
    if body[pos:].strip():
        return None  # text that is not a parameter: not a call
    return name, json.dumps(arguments, ensure_ascii=False)
