"""MiniMax-M2 XML tool calls through OutputParser: parallel invokes in one block, values
converted by the tools' schema types, reasoning before them; whole and in every chunking; and
`auto` picks the format from a MiniMax-style template."""

from __future__ import annotations

import pytest

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.tool_formats.output_format import ToolFormat, detect_format
from tests.engine.server.format_cases import Case, check_every_split

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "line": {"type": "integer"},
                    "force": {"type": "boolean"},
                    "files": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    }
]
MINIMAX = {
    "reasoning": True,
    "tools": True,
    "tool_format": ToolFormat.MINIMAX_M2,
    "schemas": ToolSchemas.of(TOOLS),
}


def invoke(name: str, *parameters: tuple[str, str]) -> str:
    body = "".join(f'<parameter name="{key}">{value}</parameter>\n' for key, value in parameters)
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


EDIT = invoke("edit", ("path", "123"), ("line", "42"), ("force", "true"), ("files", '["a", "b"]'))
EDIT_ARGS = {"path": "123", "line": 42, "force": True, "files": ["a", "b"]}
CODE = "def f(x):\n    return x < 2\n"

CASES = [
    Case("typed-values", block(EDIT), calls=(("edit", EDIT_ARGS),), options=MINIMAX),
    Case(
        "think-content-parallel-calls",
        f"<think>\nTwo calls.\n</think>\n\nOn it.\n{block(EDIT, invoke('run'))}",
        content="On it.\n",
        reasoning="Two calls.\n",
        calls=(("edit", EDIT_ARGS), ("run", {})),
        options=MINIMAX,
    ),
    Case(
        "code-keeps-its-layout",
        block(invoke("edit", ("path", f"\n{CODE}\n"))),
        calls=(("edit", {"path": CODE}),),
        options=MINIMAX,
    ),
    Case(
        "missing-parameter-close",
        block(
            '<invoke name="edit">\n<parameter name="path">a.py\n<parameter name="line">7\n'
            "</invoke>\n"
        ),
        calls=(("edit", {"path": "a.py", "line": 7}),),
        options=MINIMAX,
    ),
    Case(
        "not-an-invoke-is-content",
        '<invoke name="x">plain words</invoke>',
        content='<invoke name="x">plain words</invoke>',
        options=MINIMAX,
    ),
    Case(
        "tools-off",
        f"Here: {block(invoke('run'))}",
        content=f"Here: {block(invoke('run'))}",
        options={**MINIMAX, "tools": False},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_every_split(case: Case) -> None:
    check_every_split(case)


def test_auto_picks_the_format_from_the_template() -> None:
    template = '{% if tools %}<minimax:tool_call>\n<invoke name="...">{% endif %}'
    assert detect_format(template) is ToolFormat.MINIMAX_M2
