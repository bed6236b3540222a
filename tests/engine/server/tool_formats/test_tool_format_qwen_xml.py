"""Qwen3-Coder XML tool calls through OutputParser: recorded outputs with values converted by
the tools' schema types, whole and in every chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.tool_formats.output_format import ToolFormat
from dgpp.engine.server.tool_formats.qwen_xml import qwen_xml_call
from tests.engine.server.format_cases import Case, check_every_split, chunked, expected, parse

PROPERTIES = {
    "path": {"type": "string"},
    "line": {"type": "integer"},
    "ratio": {"type": "number"},
    "force": {"type": "boolean"},
    "options": {"type": "object"},
    "files": {"type": "array", "items": {"type": "string"}},
    "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {"type": "object", "properties": PROPERTIES},
        },
    }
]
SCHEMAS = ToolSchemas.of(TOOLS)
QWEN = {"reasoning": True, "tools": True, "tool_format": ToolFormat.QWEN3_CODER, "schemas": SCHEMAS}


def call(name: str, *parameters: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CODE = "def f(x):\n    if x < 2:\n        return x\n    return f(x - 1)\n"
TYPED = call(
    "edit",
    ("path", "123"),
    ("line", "42"),
    ("ratio", "0.5"),
    ("force", "True"),
    ("options", '{"indent": 4}'),
    ("files", '["a.py", "b.py"]'),
    ("limit", "None"),
)
TYPED_ARGS = {
    "path": "123",
    "line": 42,
    "ratio": 0.5,
    "force": True,
    "options": {"indent": 4},
    "files": ["a.py", "b.py"],
    "limit": None,
}
CODE_CALL = call("edit", ("path", "fib.py"), ("options", CODE))

CASES = [
    Case("typed-values", TYPED, calls=(("edit", TYPED_ARGS),), options=QWEN),
    Case(
        "think-content-two-calls",
        f"<think>\nTwo edits.\n</think>\n\nEditing now.\n{TYPED}\n{call('run')}",
        content="Editing now.\n",
        reasoning="Two edits.\n",
        calls=(("edit", TYPED_ARGS), ("run", {})),
        options=QWEN,
    ),
    Case(
        "code-value-keeps-its-layout",
        call("edit", ("path", "fib.py"), ("path", CODE)),
        calls=(("edit", {"path": CODE}),),  # the later value of a repeated key wins
        options=QWEN,
    ),
    Case(
        "object-typed-code-is-text-when-not-json",
        CODE_CALL,
        calls=(("edit", {"path": "fib.py", "options": CODE}),),
        options=QWEN,
    ),
    Case(
        "untyped-parameter-stays-text",
        call("search", ("query", "42"), ("regex", "a<b")),
        calls=(("search", {"query": "42", "regex": "a<b"}),),
        options=QWEN,
    ),
    Case(
        "missing-parameter-close",
        "<tool_call>\n<function=edit>\n<parameter=path>\na.py\n<parameter=line>\n7\n"
        "</function>\n</tool_call>",
        calls=(("edit", {"path": "a.py", "line": 7}),),
        options=QWEN,
    ),
    Case(
        "missing-function-close",
        "<tool_call>\n<function=edit>\n<parameter=line>\n7\n</parameter>\n</tool_call>",
        calls=(("edit", {"line": 7}),),
        options=QWEN,
    ),
    Case(
        "bad-integer-stays-text",
        call("edit", ("line", "seven")),
        calls=(("edit", {"line": "seven"}),),
        options=QWEN,
    ),
    Case(
        "not-a-function-is-content",
        "<tool_call>\nplain words\n</tool_call>",
        content="<tool_call>\nplain words\n</tool_call>",
        options=QWEN,
    ),
    Case(
        "hermes-json-body",
        '<tool_call>\n{"name": "run", "arguments": {}}\n</tool_call>',
        calls=(("run", {}),),
        options=QWEN,
    ),
    Case(
        "unclosed-block-is-content",
        "Let me edit.\n<tool_call>\n<function=edit>\n<parameter=path>\na",
        content="Let me edit.\n<tool_call>\n<function=edit>\n<parameter=path>\na",
        options=QWEN,
    ),
    Case(  # MiMo-V2-Flash's template writes values inline, and may a value over lines
        "mimo-inline-values",
        "<tool_call>\n<function=edit>\n<parameter=path>a.py</parameter>\n"
        "<parameter=line>7</parameter>\n<parameter=options>two\nlines</parameter>\n"
        "</function>\n</tool_call>",
        calls=(("edit", {"path": "a.py", "line": 7, "options": "two\nlines"}),),
        options=QWEN,
    ),
    Case(
        "tools-off",
        f"Here: {call('run')}",
        content=f"Here: {call('run')}",
        options={**QWEN, "tools": False},
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
        "\n<function=>\n</function>\n",  # no name
        "\n<function=f>\nstray text\n</function>\n",
        "\n<function=f>\n</function>\ntrailing\n",
        "\n<function=f>\n<parameter=>\nx\n</parameter>\n</function>\n",  # empty key
    ],
)
def test_bodies_that_are_not_calls(body: str) -> None:
    assert qwen_xml_call(body, SCHEMAS) is None
