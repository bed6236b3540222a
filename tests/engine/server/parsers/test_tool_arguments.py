"""Arguments written as text, typed by the request's tool schemas."""

from __future__ import annotations

from typing import Any

import pytest

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas, convert_argument

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "s": {"type": "string"},
                    "i": {"type": "integer"},
                    "n": {"type": "number"},
                    "b": {"type": "boolean"},
                    "o": {"type": "object"},
                    "a": {"type": "array"},
                    "maybe": {"type": ["integer", "null"]},
                    "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                    "open": {"anyOf": [{"type": "integer"}, {}]},
                    "color": {"enum": ["red", "blue"]},
                    "level": {"enum": [1, 2]},
                    "free": {},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "g"}},  # no parameters schema at all
]
SCHEMAS = ToolSchemas.of(TOOLS)


@pytest.mark.parametrize(
    ("parameter", "types"),
    [
        ("s", {"string"}),
        ("maybe", {"integer", "null"}),
        ("either", {"string", "integer"}),
        ("open", None),
        ("color", {"string"}),
        ("level", {"integer"}),
        ("free", None),
        ("absent", None),
    ],
)
def test_types(parameter: str, types: set[str] | None) -> None:
    assert SCHEMAS.types("f", parameter) == (None if types is None else frozenset(types))


def test_unknown_tools_say_nothing() -> None:
    assert SCHEMAS.types("g", "x") is None and SCHEMAS.types("h", "x") is None
    assert ToolSchemas.of(None).types("f", "s") is None


@pytest.mark.parametrize(
    ("raw", "parameter", "value"),
    [
        ("42", "s", "42"),
        (" spaced ", "s", " spaced "),
        ("42", "i", 42),
        ("3.0", "i", 3),
        ("seven", "i", "seven"),
        ("1.5", "n", 1.5),
        ("True", "b", True),
        ("false", "b", False),
        (' {"k": [1]} ', "o", {"k": [1]}),
        ("[1, 2]", "a", [1, 2]),
        ("None", "maybe", None),
        ("null", "maybe", None),
        ("5", "maybe", 5),
        ("5", "either", "5"),
        ("NaN", "n", "NaN"),
        ("not json", "o", "not json"),
    ],
)
def test_typed_values(raw: str, parameter: str, value: Any) -> None:
    assert convert_argument(raw, SCHEMAS.types("f", parameter), untyped_json=False) == value


def test_untyped_values_follow_the_format() -> None:
    assert convert_argument("5", None, untyped_json=True) == 5
    assert convert_argument('{"a": 1}', None, untyped_json=True) == {"a": 1}
    assert convert_argument("hello", None, untyped_json=True) == "hello"
    assert convert_argument("5", None, untyped_json=False) == "5"
