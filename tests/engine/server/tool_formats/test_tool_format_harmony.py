"""gpt-oss harmony output through OutputParser: recorded outputs (analysis, final, preambles, tool
calls with the recipient before or after the channel), whole and in every chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from dgpp.engine.server.parsers.special_tokens import SpecialTokenText
from dgpp.engine.server.tool_formats.output_format import ToolFormat
from dgpp.engine.server.tool_formats.output_parser import OutputParser, ParsedDelta
from tests.engine.server.format_cases import Case, check_every_split, chunked, expected, parse

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"]
SPECIAL = SpecialTokenText([*MARKERS, "<|constrain|>", "<|endoftext|>", "<|reserved_200013|>"])
HARMONY = {
    "reasoning": False,
    "tools": True,
    "tool_format": ToolFormat.HARMONY,
    "special_tokens": SPECIAL,
}
ANALYSIS = "<|channel|>analysis<|message|>User asks for the weather in SF. Call the tool.<|end|>"
CALL_AFTER_CHANNEL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"San Francisco"}'
)
CALL_BEFORE_CHANNEL = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"location":"SF"}'
)
SF = ("get_weather", {"location": "San Francisco"})

CASES = [
    Case(
        "analysis-then-final",
        "<|channel|>analysis<|message|>Simple arithmetic: 2 + 2 = 4.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
        content="2 + 2 = 4.",
        reasoning="Simple arithmetic: 2 + 2 = 4.",
        options=HARMONY,
    ),
    Case(
        "final-with-return-in-text",
        "<|channel|>final<|message|>Hello!<|return|>",
        content="Hello!",
        options=HARMONY,
    ),
    Case(
        "analysis-then-call",
        ANALYSIS + CALL_AFTER_CHANNEL,
        reasoning="User asks for the weather in SF. Call the tool.",
        calls=(SF,),
        options=HARMONY,
    ),
    Case(
        "recipient-before-channel",
        ANALYSIS + CALL_BEFORE_CHANNEL + "<|call|>",
        reasoning="User asks for the weather in SF. Call the tool.",
        calls=(("get_weather", {"location": "SF"}),),
        options=HARMONY,
    ),
    Case(
        "first-header-has-the-recipient",
        ' to=functions.lookup<|channel|>commentary json<|message|>{"id": 7}',
        calls=(("lookup", {"id": 7}),),
        options=HARMONY,
    ),
    Case(
        "preamble-then-two-calls",
        "<|channel|>commentary<|message|>Checking two cities.<|end|>"
        + CALL_AFTER_CHANNEL
        + "<|call|>"
        + CALL_BEFORE_CHANNEL,
        content="Checking two cities.",
        calls=(SF, ("get_weather", {"location": "SF"})),
        options=HARMONY,
    ),
    Case(
        "tools-off-call-body-is-content",
        ANALYSIS + CALL_AFTER_CHANNEL,
        content='{"location":"San Francisco"}',
        reasoning="User asks for the weather in SF. Call the tool.",
        options={**HARMONY, "tools": False},
    ),
    Case(
        "arguments-that-are-not-json-pass-through",
        "<|channel|>analysis to=python code<|message|>print(1 + 1)",
        calls=(("python", "print(1 + 1)"),),
        options=HARMONY,
    ),
    Case(
        "other-special-tokens-stripped",
        "<|channel|>analysis<|message|>think<|reserved_200013|>ing<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hi<|endoftext|> there",
        content="Hi there",
        reasoning="thinking",
        options=HARMONY,
    ),
    Case(
        "lookalikes-in-final",
        "<|channel|>final<|message|>a <|b|> and < | and <|en d",
        content="a <|b|> and < | and <|en d",
        options=HARMONY,
    ),
    Case(
        "plain-text-output",
        "Just text, no harmony.",
        content="Just text, no harmony.",
        options=HARMONY,
    ),
    Case(
        "truncated-analysis",
        "<|channel|>analysis<|message|>Still thinking about",
        reasoning="Still thinking about",
        options=HARMONY,
    ),
    Case(
        "truncated-header-is-dropped",
        "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>fin",
        reasoning="Done.",
        options=HARMONY,
    ),
    Case(
        "header-after-end-without-start",
        "<|channel|>analysis<|message|>a<|end|><|channel|>final<|message|>b",
        content="b",
        reasoning="a",
        options=HARMONY,
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


def test_reasoning_and_content_stream_before_their_messages_end() -> None:
    parser = OutputParser(**HARMONY)
    assert parser.feed("<|channel|>analysis") == ParsedDelta()  # a header is held
    assert parser.feed("<|message|>Let me") == ParsedDelta(reasoning="Let me")
    assert parser.feed(" see.<|e") == ParsedDelta(reasoning=" see.")
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>4") == ParsedDelta(
        content="4"
    )
    assert parser.finish() == ParsedDelta()


def test_a_call_comes_whole_when_the_output_ends() -> None:
    parser = OutputParser(**HARMONY)
    assert parser.feed(CALL_AFTER_CHANNEL) == ParsedDelta()
    assert parser.num_tool_calls == 0
    (call,) = parser.finish().tool_calls
    assert (call.index, call.name, call.arguments) == (
        0,
        "get_weather",
        '{"location": "San Francisco"}',
    )
    assert parser.tool_calls()[0]["function"]["name"] == "get_weather"
