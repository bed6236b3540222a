"""DeepSeek's DSML tool calls (V3.2, V4) through OutputParser: parallel invokes in one block, values
by their `string` flag (text, or JSON) and by the schema where the flag is missing, reasoning
before them; whole and in every chunking; and `auto` picks the format from a DSML template."""

from __future__ import annotations

import pytest

from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.tool_formats.output_format import ToolFormat, detect_format
from tests.engine.server.format_cases import Case, check_every_split
from tests.engine.server.tool_formats.test_tool_format_minimax import TOOLS  # the same tool schema

DSML_OPTIONS = {
    "reasoning": True,
    "tools": True,
    "tool_format": ToolFormat.DSML,
    "schemas": ToolSchemas.of(TOOLS),
}
D = "｜DSML｜"


def parameter(key: str, value: str, string: str | None) -> str:
    flag = "" if string is None else f' string="{string}"'
    return f'<{D}parameter name="{key}"{flag}>{value}</{D}parameter>\n'


def invoke(name: str, *parameters: str) -> str:
    return f'<{D}invoke name="{name}">\n{"".join(parameters)}</{D}invoke>\n'


def block(*invokes: str, name: str = "function_calls") -> str:
    return f"<{D}{name}>\n" + "".join(invokes) + f"</{D}{name}>"


EDIT = invoke(
    "edit",
    parameter("path", "123", "true"),  # a string that looks like a number stays one
    parameter("line", "42", "false"),
    parameter("force", "true", "false"),
    parameter("files", '["a", "b"]', "false"),
)
EDIT_ARGS = {"path": "123", "line": 42, "force": True, "files": ["a", "b"]}
CODE = "def f(x):\n    return x < 2\n"

CASES = [
    Case("flagged-values", block(EDIT), calls=(("edit", EDIT_ARGS),), options=DSML_OPTIONS),
    Case(
        "think-content-parallel-calls",
        f"<think>\nTwo calls.\n</think>\n\nOn it.\n{block(EDIT, invoke('run'))}",
        content="On it.\n",
        reasoning="Two calls.\n",
        calls=(("edit", EDIT_ARGS), ("run", {})),
        options=DSML_OPTIONS,
    ),
    Case(
        "v4-tool-calls-block",
        f"Sure.\n\n{block(EDIT, name='tool_calls')}",
        content="Sure.\n\n",
        calls=(("edit", EDIT_ARGS),),
        options=DSML_OPTIONS,
    ),
    Case(
        "unflagged-values-by-schema",
        block(invoke("edit", parameter("path", "7", None), parameter("line", "7", None))),
        calls=(("edit", {"path": "7", "line": 7}),),
        options=DSML_OPTIONS,
    ),
    Case(
        "an-object-value-and-code-text",
        block(
            invoke(
                "patch",
                parameter("options", '{"dry": true, "n": 2}', "false"),
                parameter("code", f"\n{CODE}\n", "true"),
            )
        ),
        calls=(("patch", {"options": {"dry": True, "n": 2}, "code": CODE}),),
        options=DSML_OPTIONS,
    ),
    Case(
        "not-an-invoke-is-content",
        f'<{D}invoke name="x">plain words</{D}invoke>',
        content=f'<{D}invoke name="x">plain words</{D}invoke>',
        options=DSML_OPTIONS,
    ),
    Case(
        "tools-off",
        f"Here: {block(invoke('run'))}",
        content=f"Here: {block(invoke('run'))}",
        options={**DSML_OPTIONS, "tools": False},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_every_split(case: Case) -> None:
    check_every_split(case)


def test_auto_picks_the_format_from_the_template() -> None:
    template = "{% if tools %}<｜DSML｜function_calls>\n<｜DSML｜invoke name={% endif %}"
    assert detect_format(template) is ToolFormat.DSML
    # DeepSeek-V3's template names its own markers; it stays deepseek_v3
    assert detect_format("<｜tool▁calls▁begin｜>") is ToolFormat.DEEPSEEK_V3
