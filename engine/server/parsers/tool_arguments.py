"""Typed tool-call arguments from formats that write each argument as text (GLM `<arg_value>`,
Qwen3-Coder `<parameter=…>`): the request's tool schemas say which type each parameter has.

Templates of these families write a string argument as it is and anything else as JSON (GLM's
`tojson`), or as Python's `str()` of the value (Qwen3-Coder: `True`, `None`, `3`), so a value is
kept as text where the schema allows a string, and otherwise read as JSON, with `true`/`false`/
`none`/`null` in any case accepted for booleans and null. Text that does not read as the schema's
type stays a string: the client gets what the model wrote rather than an error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# JSON Schema's type names, and the Python types json.loads gives for each.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _schema_types(schema: object) -> frozenset[str] | None:
    """The JSON types a property schema allows; None when it does not say."""
    if not isinstance(schema, Mapping):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        return frozenset(declared)
    found: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types = _schema_types(option)
            if types is None:
                return None  # one open option makes the whole property open
            found |= types
    if "enum" in schema and isinstance(schema["enum"], list):
        for value in schema["enum"]:
            found.add("string" if isinstance(value, str) else _type_of(value))
    return frozenset(found) or None


def _type_of(value: object) -> str:
    for name, types in _JSON_TYPES.items():
        if isinstance(value, types) and not (isinstance(value, bool) and name != "boolean"):
            return name
    return "string"


@dataclass(frozen=True)
class ToolSchemas:
    """Each offered function's parameter schemas, by function name."""

    properties: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None) -> ToolSchemas:
        """From tools in the Chat Completions shape (`{"type": "function", "function": {...}}`)."""
        properties: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function") or tool
            parameters = function.get("parameters")
            if isinstance(function.get("name"), str) and isinstance(parameters, Mapping):
                props = parameters.get("properties")
                properties[function["name"]] = props if isinstance(props, Mapping) else {}
        return cls(properties)

    def types(self, tool: str, parameter: str) -> frozenset[str] | None:
        """The types the schema allows for `parameter` of `tool`; None when it does not say."""
        return _schema_types(self.properties.get(tool, {}).get(parameter))


def convert_argument(raw: str, types: frozenset[str] | None, *, untyped_json: bool) -> Any:
    """The value of one argument written as text.

    `types`: what the schema allows (None: it does not say, and then `untyped_json` decides
    between reading JSON, as GLM writes non-strings, and keeping the text, as Qwen3-Coder's
    parser convention is). A schema that allows a string keeps the text unchanged.
    """
    if types is None:
        return _json_or_text(raw) if untyped_json else raw
    if "string" in types:
        return raw
    text = raw.strip()
    word = text.lower()
    if "null" in types and word in ("null", "none"):
        return None
    if "boolean" in types and word in ("true", "false"):
        return word == "true"
    value = _json_or_text(text)
    if value is text:
        return raw
    if "integer" in types and isinstance(value, float) and value.is_integer():
        return int(value)  # "3.0" for an integer parameter
    return value


def _json_or_text(text: str) -> Any:
    """`text` read as JSON, or `text` itself (the same object) when it is not JSON."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return text


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity would not survive json.dumps
