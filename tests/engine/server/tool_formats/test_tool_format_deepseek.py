"""DeepSeek-V3 / V3.1 tool calls and reasoning through OutputParser: recorded outputs in both
forms, whole and in every chunking, with the markers stripped where they are special tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from dgpp.engine.server.parsers.special_tokens import SpecialTokenText
from dgpp.engine.server.tool_formats.deepseek import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEPARATOR,
    deepseek_call,
)
from dgpp.engine.server.tool_formats.output_format import ToolFormat
from tests.engine.server.format_cases import Case, check_every_split, chunked, expected, parse

EOS = "<｜end▁of▁sentence｜>"
SPECIAL = SpecialTokenText([CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEPARATOR, EOS])
DEEPSEEK = {"reasoning": True, "tools": True, "tool_format": ToolFormat.DEEPSEEK_V3}
STRIPPED = {**DEEPSEEK, "special_tokens": SPECIAL}


def v3(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEPARATOR}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEPARATOR}{arguments}{CALL_END}"


CITY = '{"city": "Tokyo"}'
V3_TWO = CALLS_BEGIN + v3("get_weather", CITY) + "\n" + v3("now", "{}") + CALLS_END
V31_TWO = CALLS_BEGIN + v31("get_weather", CITY) + v31("now", "{}") + CALLS_END
TOKYO = ("get_weather", {"city": "Tokyo"})
BAD = CALLS_BEGIN + v31("get_weather", "{city: Tokyo}") + CALLS_END
PLAN = '{"steps": [{"n": 1}], "note": "a ```b```"}'

CASES = [
    Case(
        "v3-content-then-calls",
        f"Let me check both.\n\n{V3_TWO}",
        content="Let me check both.\n\n",
        calls=(TOKYO, ("now", {})),
        options=DEEPSEEK,
    ),
    Case("v31-two-calls", V31_TWO, calls=(TOKYO, ("now", {})), options=DEEPSEEK),
    Case(
        "v31-thinking-then-call",
        f"The user asks about Tokyo.\n</think>I will call the tool.{V31_TWO}",
        content="I will call the tool.",
        reasoning="The user asks about Tokyo.\n",
        calls=(TOKYO, ("now", {})),
        options={**STRIPPED, "starts_in_reasoning": True},
    ),
    Case(
        "r1-think-block",
        f"<think>\nNeed the weather.\n</think>\n\n{V31_TWO}",
        reasoning="Need the weather.\n",
        calls=(TOKYO, ("now", {})),
        options=STRIPPED,
    ),
    Case(
        "v31-tool-named-function",
        CALLS_BEGIN + v31("function", '{"a": 1}') + CALLS_END,
        calls=(("function", {"a": 1}),),
        options=DEEPSEEK,
    ),
    Case(
        "v3-nested-arguments",
        CALLS_BEGIN + v3("plan", PLAN) + CALLS_END,
        calls=(("plan", {"steps": [{"n": 1}], "note": "a ```b```"}),),
        options=DEEPSEEK,
    ),
    Case(
        "content-after-calls",
        f"{V31_TWO}\nDone.",
        content="\nDone.",
        calls=(TOKYO, ("now", {})),
        options=DEEPSEEK,
    ),
    Case(
        "invalid-call-unstripped",
        BAD,
        content=BAD.removeprefix(CALLS_BEGIN).removesuffix(CALLS_END),
        options=DEEPSEEK,
    ),
    Case(
        "invalid-call-markers-stripped",
        f"Hmm. {BAD}",
        content="Hmm. get_weather{city: Tokyo}",
        options=STRIPPED,
    ),
    Case(
        "tools-off-markers-stripped",
        f"Plan: {V31_TWO}{EOS}",
        content='Plan: get_weather{"city": "Tokyo"}now{}',
        options={**STRIPPED, "tools": False},
    ),
    Case(
        "unclosed-call-stripped",
        f"Sure. {CALLS_BEGIN}{CALL_BEGIN}get_weather{SEPARATOR}{{",
        content="Sure. get_weather{",
        options=STRIPPED,
    ),
    Case("lookalike-text", "a <｜tool b ｜> c", content="a <｜tool b ｜> c", options=STRIPPED),
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
        'get_weather{"city": "x"}',  # no separator
        f"get_weather{SEPARATOR}[1, 2]",  # arguments not an object
        f"two words{SEPARATOR}{{}}",
        f"function{SEPARATOR}get_weather\n```json\n{{bad}}\n```",
    ],
)
def test_bodies_that_are_not_calls(body: str) -> None:
    assert deepseek_call(body) is None


def test_v3_fence_without_language() -> None:
    body = f"function{SEPARATOR}now\n```\n{{}}\n```"
    assert deepseek_call(body) == ("now", "{}")
