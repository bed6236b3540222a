"""GLM-4.5/4.6 tool calls and reasoning through OutputParser: recorded outputs, whole and in
every chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.tool_formats.glm import glm_call
from dgpp.engine.server.tool_formats.output_format import ToolFormat
from tests.engine.server.format_cases import Case, check_every_split, chunked, expected, parse

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"enum": ["celsius", "fahrenheit"]},
                    "detailed": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "mode": {"type": ["integer", "null"]},
                    "tags": {"type": "array"},
                    "meta": {"type": "object"},
                },
            },
        },
    },
]
SCHEMAS = ToolSchemas.of(TOOLS)
GLM = {"reasoning": True, "tools": True, "tool_format": ToolFormat.GLM45, "schemas": SCHEMAS}

WEATHER = (
    "<tool_call>get_weather\n"
    "<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
    "</tool_call>"
)
WEATHER_ARGS = {"city": "Beijing", "days": 3}
CODE = 'def main():\n    print("hi")\n\n'
WRITE = (
    "<tool_call>write_file\n"
    "<arg_key>path</arg_key>\n<arg_value>007</arg_value>\n"
    f"<arg_key>content</arg_key>\n<arg_value>{CODE}</arg_value>\n"
    "<arg_key>mode</arg_key>\n<arg_value>null</arg_value>\n"
    '<arg_key>tags</arg_key>\n<arg_value>["a", "b"]</arg_value>\n'
    '<arg_key>meta</arg_key>\n<arg_value>{"owner": "me"}</arg_value>\n'
    "</tool_call>"
)
WRITE_ARGS = {
    "path": "007",
    "content": CODE,
    "mode": None,
    "tags": ["a", "b"],
    "meta": {"owner": "me"},
}
JUNK = "<tool_call>get_weather\nplease <arg_key>city</arg_key><arg_value>x</arg_value></tool_call>"

CASES = [
    Case(
        "think-content-call",
        "<think>The user wants Beijing's weather for 3 days.</think>\n"
        f"I'll look that up.\n{WEATHER}",
        content="I'll look that up.\n",
        reasoning="The user wants Beijing's weather for 3 days.",
        calls=(("get_weather", WEATHER_ARGS),),
        options=GLM,
    ),
    Case(
        "two-calls",
        f"{WEATHER}\n{WRITE}\n",
        calls=(("get_weather", WEATHER_ARGS), ("write_file", WRITE_ARGS)),
        options=GLM,
    ),
    Case(
        "string-schema-keeps-json-looking-text",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>42</arg_value>\n"
        "<arg_key>units</arg_key>\n<arg_value>celsius</arg_value>\n"
        "<arg_key>detailed</arg_key>\n<arg_value>true</arg_value>\n</tool_call>",
        calls=(("get_weather", {"city": "42", "days": 42, "units": "celsius", "detailed": True}),),
        options=GLM,
    ),
    Case(
        "untyped-values-read-as-json",
        "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>dgpp</arg_value>\n"
        "<arg_key>limit</arg_key>\n<arg_value>5</arg_value>\n</tool_call>",
        calls=(("search", {"q": "dgpp", "limit": 5}),),
        options=GLM,
    ),
    Case(
        "no-arguments",
        "Checking the clock.<tool_call>now</tool_call>",
        content="Checking the clock.",
        calls=(("now", {}),),
        options=GLM,
    ),
    Case(
        "glm47-no-newline-after-name",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
        calls=(("get_weather", {"city": "Paris"}),),
        options=GLM,
    ),
    Case(
        "hermes-json-body",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        calls=(("get_weather", {"city": "Oslo"}),),
        options=GLM,
    ),
    Case("junk-in-block-is-content", f"Hi {JUNK} bye", content=f"Hi {JUNK} bye", options=GLM),
    Case(
        "unclosed-call-is-content",
        "Sure.\n<tool_call>get_weather\n<arg_key>city",
        content="Sure.\n<tool_call>get_weather\n<arg_key>city",
        options=GLM,
    ),
    Case(
        "call-inside-reasoning-is-reasoning",
        f"<think>maybe {WEATHER}</think>\nNo call needed.",
        content="No call needed.",
        reasoning=f"maybe {WEATHER}",
        options=GLM,
    ),
    Case(
        "tools-off-is-content",
        f"Sure.\n{WEATHER}",
        content=f"Sure.\n{WEATHER}",
        options={**GLM, "tools": False},
    ),
    Case(
        "thinking-disabled-prompt",
        f"Let me check.\n{WEATHER}\n\nDone.",
        content="Let me check.\nDone.",
        calls=(("get_weather", WEATHER_ARGS),),
        options=GLM,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_every_split(case: Case) -> None:
    check_every_split(case)


@settings(max_examples=300, deadline=None)
@given(chunked(CASES))
def test_any_chunking(drawn: tuple[Case, list[str]]) -> None:
    case, chunks = drawn
    assert parse(chunks, case.options) == expected(case), chunks


@pytest.mark.parametrize(
    "body",
    [
        "",
        "\n<arg_key>city</arg_key><arg_value>x</arg_value>",  # no name
        "two words\n",
        "f\n<arg_key> </arg_key><arg_value>x</arg_value>",  # empty key
        "f\n<arg_key>a</arg_key>",  # key without value
    ],
)
def test_bodies_that_are_not_calls(body: str) -> None:
    assert glm_call(body, SCHEMAS) is None


def test_string_values_keep_their_whitespace() -> None:
    body = "write_file\n<arg_key>content</arg_key>\n<arg_value>  two spaces \n</arg_value>\n"
    assert glm_call(body, SCHEMAS) == ("write_file", '{"content": "  two spaces \\n"}')
