"""Kimi K2 tool calls (Kimi K2, Kimi-Linear) through OutputParser: recorded outputs whole and in
every chunking, the model's own call ids kept (its template renders them back), repeated ids
made unique, the markers stripped where they are special tokens; and the format is chosen from a
chat template that writes the section marker."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from dgpp.engine.server.parsers.special_tokens import SpecialTokenText
from dgpp.engine.server.tool_formats.kimi import (
    ARGUMENTS,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    kimi_call,
)
from dgpp.engine.server.tool_formats.output_format import ToolFormat, detect_format
from dgpp.engine.server.tool_formats.output_parser import OutputParser
from tests.engine.server.format_cases import Case, check_every_split, chunked, expected, parse

EOS = "<|im_end|>"
SPECIAL = SpecialTokenText([CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, ARGUMENTS, EOS])
KIMI = {"reasoning": True, "tools": True, "tool_format": ToolFormat.KIMI_K2}
STRIPPED = {**KIMI, "special_tokens": SPECIAL}


def call(call_id: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{call_id}{ARGUMENTS}{arguments}{CALL_END}"


TWO = (
    CALLS_BEGIN
    + call("functions.get_weather:0", '{"city": "Tokyo"}')
    + call("functions.now:1", "{}")
    + CALLS_END
)
TOKYO = ("get_weather", {"city": "Tokyo"})
BAD = CALLS_BEGIN + call("functions.get_weather:0", "{city: Tokyo}") + CALLS_END

CASES = [
    Case(
        "content-then-two-calls",
        f"Checking both.\n{TWO}",
        content="Checking both.\n",
        calls=(TOKYO, ("now", {})),
        options=KIMI,
    ),
    Case(
        "thinking-then-call",
        f"<think>Need the weather.</think>{TWO}",
        reasoning="Need the weather.",
        calls=(TOKYO, ("now", {})),
        options=STRIPPED,
    ),
    Case(
        "id-without-prefix",
        CALLS_BEGIN + call("search:3", '{"q": "a<b"}') + CALLS_END,
        calls=(("search", {"q": "a<b"}),),
        options=KIMI,
    ),
    Case(
        "invalid-call-markers-stripped",
        f"Hmm. {BAD}",
        content="Hmm. functions.get_weather:0{city: Tokyo}",
        options=STRIPPED,
    ),
    Case(
        "tools-off-markers-stripped",
        f"Plan: {TWO}{EOS}",
        content='Plan: functions.get_weather:0{"city": "Tokyo"}functions.now:1{}',
        options={**STRIPPED, "tools": False},
    ),
    Case(
        "unclosed-call-stripped",
        f"Sure. {CALLS_BEGIN}{CALL_BEGIN}functions.f:0{ARGUMENTS}{{",
        content="Sure. functions.f:0{",
        options=STRIPPED,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_every_split(case: Case) -> None:
    check_every_split(case)


@settings(max_examples=200, deadline=None)
@given(chunked(CASES))
def test_any_chunking(drawn: tuple[Case, list[str]]) -> None:
    case, chunks = drawn
    assert parse(chunks, case.options) == expected(case), chunks


def test_the_model_ids_are_kept_and_repeats_replaced() -> None:
    parser = OutputParser(**KIMI)
    text = CALLS_BEGIN + call("functions.a:0", "{}") + call("functions.a:0", "{}") + CALLS_END
    parser.feed(text)
    parser.finish()
    ids = [entry["id"] for entry in parser.tool_calls()]
    assert ids[0] == "functions.a:0" and ids[1].startswith("call_")


@pytest.mark.parametrize(
    "body",
    ["functions.f:0", f"{ARGUMENTS}{{}}", f"two words{ARGUMENTS}{{}}", f"f:0{ARGUMENTS}[1]"],
)
def test_bodies_that_are_not_calls(body: str) -> None:
    assert kimi_call(body) is None


def test_the_template_chooses_the_format() -> None:
    template = "{%- if tool_calls -%}<|tool_calls_section_begin|>{%- endif -%}"
    assert detect_format(template) is ToolFormat.KIMI_K2
