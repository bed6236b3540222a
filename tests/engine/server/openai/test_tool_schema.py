"""A tool's parameters are checked against the JSON Schema meta-schemas, tolerant of the drafts
clients write, and never by fetching anything."""

from __future__ import annotations

import time

import pytest

from dgpp.engine.server.openai.tool_schema import schema_problem

# Claude Code's Bash tool as it sends it (draft-07, additionalProperties false).
CLAUDE_CODE_BASH = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The command to execute"},
        "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
    },
    "required": ["command"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "schema",
    [
        {},
        {"type": "object"},
        CLAUDE_CODE_BASH,
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "$defs": {"a": {}}},
        {"type": "array", "items": [{"type": "string"}]},  # draft-07's tuple form, no $schema
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "prefixItems": [{}]},
        {"$schema": "http://json-schema.org/draft-04/schema", "type": "object"},
        {"type": "object", "properties": {"a": {"$ref": "https://example.invalid/a.json"}}},
        {"type": "object", "x-vendor": {"anything": [1, 2]}},
    ],
)
def test_schemas_clients_send_pass(schema: dict) -> None:
    assert schema_problem(schema) is None


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ([{"type": "object"}], "a JSON schema is an object, got list"),
        ("object", "a JSON schema is an object, got str"),
        ({"type": "objekt"}, "(at type)"),
        ({"type": "object", "properties": 5}, '5 is not of type "object" (at properties)'),
        ({"type": "object", "required": "a"}, "(at required)"),
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "(at properties/a/type)"),
        (
            {"$schema": "https://json-schema.org/draft/2020-12/schema", "items": [{}]},
            "(at items)",
        ),
        ({"$schema": "http://example.invalid/s"}, "is not a JSON Schema draft this server knows"),
        ({"$schema": 7}, "is not a JSON Schema draft this server knows"),
    ],
)
def test_what_is_no_json_schema_is_named(schema: object, problem: str) -> None:
    found = schema_problem(schema)
    assert found is not None and problem in found, found


def test_an_unknown_schema_uri_is_never_fetched() -> None:
    # The library fetches a `$schema` it does not carry; here that would hang on a closed
    # network or reach wherever the client points. Refused before the library sees it.
    started = time.monotonic()
    assert schema_problem({"$schema": "http://10.255.255.1/schema", "type": "object"})
    assert time.monotonic() - started < 0.5
