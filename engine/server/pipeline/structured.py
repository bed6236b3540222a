"""Which grammar a request's output must follow (structured outputs), per API:

- Chat Completions `response_format` `json_object` / `json_schema`, Responses `text.format`
  the same: the whole output is that JSON.
- A forced tool call (`tool_choice` `required` or a named function; Anthropic `any` / `tool`)
  whose tools are strict (`strict: true`; every Anthropic tool, whose `input_schema` is the
  contract), or any forced call where the template does not write `<tool_call>` blocks: the
  model continues the forced `<tool_call>` opening (tool_choice.py) with a tool name and
  arguments that match that tool's schema, then closes the call.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.sampling.grammar import (
    JSON_OPTIONS,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    lark_string,
)
from dgpp.engine.server.pipeline.tool_choice import ForcedStart, in_json_string

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def format_grammar(spec: dict[str, Any] | None, param: str) -> str | None:
    """The grammar of an OpenAI `response_format` (chat) or `text.format` (Responses) object;
    None for plain text. Chat nests the schema under `json_schema`, Responses does not."""
    if spec is not None and not isinstance(spec, dict):
        raise InvalidRequestError(f"{param} must be an object", param=param)
    kind = (spec or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind != "json_schema":
        raise InvalidRequestError(
            f"{param} type must be text, json_object or json_schema, got {kind!r}", param=param
        )
    assert spec is not None
    body = spec.get("json_schema", spec)
    schema = body.get("schema") if isinstance(body, dict) else None
    if schema is None:
        raise InvalidRequestError(f"{param} json_schema needs a schema", param=param)
    return json_schema_grammar(schema, f"{param}.schema")


def _strict(tool: dict[str, Any]) -> bool:
    return bool(tool.get("strict") or (tool.get("function") or {}).get("strict"))


def forced_call_grammar(
    tools: list[dict[str, Any]],
    forced: ForcedStart | None,
    name: str | None,
    strict: bool | None = None,
) -> str | None:
    """The grammar of the rest of a forced tool call, or None when nothing is forced or no
    tool is strict (`strict=True` treats every tool as strict, as for Anthropic). `tools` are
    in the Chat Completions shape, `strict: true` on the tool or its function."""
    if forced is None:
        return None
    strict = strict or forced.constrained
    functions = [(t.get("function") or t, strict or _strict(t)) for t in tools]
    if not any(is_strict for _, is_strict in functions):
        return None
    close = lark_string("}" + forced.closing)
    rules: list[str] = []
    choices: list[str] = []
    for number, (function, is_strict) in enumerate(functions):
        tool_name = str(function.get("name", ""))
        if name is not None and tool_name != name:
            continue
        schema = _parameters(function) if is_strict else ANY_OBJECT
        head = ""
        if name is None:
            head = lark_string(f'{in_json_string(tool_name)}", "arguments": ') + " "
        rules.append(f"call{number}: {head}args{number}")
        rules.append(f"args{number}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
        choices.append(f"call{number}")
    text = "\n".join([f"start: ({' | '.join(choices)}) {close}", *rules])
    return lark_grammar(text, "tools")


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema a function's arguments must match (any object when it gives none);
    every API checked it is one when the request arrived (`tool_schema.schema_problem`)."""
    return function.get("parameters") or ANY_OBJECT


async def checked(state: Any, grammar: str | None, param: str) -> str | None:
    """`grammar` once llguidance has accepted it for this model (off the event loop: the first
    use builds the tokenizer's token trie)."""
    if grammar is not None:
        await asyncio.to_thread(state.engine.engine.grammars.check, grammar, param)
    return grammar
