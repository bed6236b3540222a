"""OutputParser: every scenario parsed whole, split at every character boundary, fed one character
at a time and in random chunks must give the same content, reasoning and tool calls, and those must
be the expected ones."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import pytest

from dgpp.engine.server.tool_formats.output_parser import (
    OutputParser,
    ParsedDelta,
    ToolCallDelta,
    merge,
)

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def block(name: str, arguments: str, key: str = "arguments") -> str:
    return f'<tool_call>\n{{"name": "{name}", "{key}": {arguments}}}\n</tool_call>'


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    content: str = ""
    reasoning: str = ""
    calls: tuple[tuple[str, str], ...] = ()  # (name, arguments) in index order
    flags: dict[str, bool] = field(default_factory=lambda: {"reasoning": True, "tools": True})


WEATHER = block("get_weather", '{"city":"Paris" ,  "unit": "celsius"}')
WEATHER_CALL = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
LOOKALIKES = "a < b, <to be> <thinking> </think> <tool_call x> </tool_call> end <"
BAD_BLOCK = "<tool_call>\n{not json}\n</tool_call>"
THINK = "<think>\nx\n</think>\n\ny"
LLAMA = '{"name": "f", "parameters": {}}'

CASES = [
    Case("plain-lookalikes", LOOKALIKES, content=LOOKALIKES),
    Case(
        "think-then-content",
        "<think>\nI should greet.\n</think>\n\nHello!",
        "Hello!",
        "I should greet.\n",
    ),
    Case("only-two-newlines-dropped", "<think>x</think>\n\n\nHi", content="\nHi", reasoning="x"),
    Case("empty-think", "<think>\n\n</think>\n\nHi", content="Hi"),
    Case("two-think-blocks", "<think>a</think>b<think>\nc</think>\nd", "bd", "ac"),
    Case(
        "starts-in-reasoning",
        "Let me think.\n</think>\n\nAnswer.",
        content="Answer.",
        reasoning="Let me think.\n",
        flags={"reasoning": True, "tools": True, "starts_in_reasoning": True},
    ),
    Case(
        "starts-in-reasoning-redundant-open",
        "<think>\nHmm.</think>Hi",
        content="Hi",
        reasoning="Hmm.",
        flags={"reasoning": True, "tools": False, "starts_in_reasoning": True},
    ),
    Case(
        "starts-in-reasoning-unclosed-prefix",
        "<thi",
        reasoning="<thi",
        flags={"reasoning": True, "tools": False, "starts_in_reasoning": True},
    ),
    Case(
        "unclosed-think", "Before <think>\nstill thinking </thi", "Before ", "still thinking </thi"
    ),
    Case(
        "tool-markup-inside-reasoning-is-reasoning",
        f"<think>maybe {WEATHER}</think>Done",
        content="Done",
        reasoning=f"maybe {WEATHER}",
    ),
    Case("reasoning-off", THINK, content=THINK, flags={"reasoning": False, "tools": False}),
    Case(
        "reasoning-off-ignores-starts-in-reasoning",
        THINK,
        content=THINK,
        flags={"reasoning": False, "tools": True, "starts_in_reasoning": True},
    ),
    Case(
        "tools-off",
        f"Sure.\n{WEATHER}",
        content=f"Sure.\n{WEATHER}",
        flags={"reasoning": True, "tools": False},
    ),
    Case(
        "content-before-call", f"Let me check.\n{WEATHER}", "Let me check.\n", calls=(WEATHER_CALL,)
    ),
    Case(
        "three-calls",
        "\n".join([block("a", "{}"), block("b", '{"x": 1}'), block("c", "{}", "parameters")])
        + "\n",
        calls=(("a", "{}"), ("b", '{"x": 1}'), ("c", "{}")),
    ),
    Case("list-arguments-is-content", block("c", "[1]"), content=block("c", "[1]")),
    Case(
        "reasoning-then-call",
        f"<think>\nNeed the weather.\n</think>\n\n{WEATHER}",
        reasoning="Need the weather.\n",
        calls=(WEATHER_CALL,),
    ),
    Case("string-arguments", block("f", '"{\\"x\\": 1}"'), calls=(("f", '{"x": 1}'),)),
    Case("missing-arguments", '<tool_call>\n{"name": "now"}\n</tool_call>', calls=(("now", "{}"),)),
    Case("parameters-key", block("f", '{"a": 2}', "parameters"), calls=(("f", '{"a": 2}'),)),
    Case(
        "unicode-arguments", block("f", '{"city": "Zürich"}'), calls=(("f", '{"city": "Zürich"}'),)
    ),
    Case(
        "closing-tag-inside-an-argument",
        block("ls", '{"path": "a}}</tool_call>\\"</tool_call>"}') + "\nok",
        content="ok",
        calls=(("ls", '{"path": "a}}</tool_call>\\"</tool_call>"}'),),
    ),
    Case("invalid-json-block", f"Hi {BAD_BLOCK} bye", content=f"Hi {BAD_BLOCK} bye"),
    Case("block-without-name", block("", "{}"), content=block("", "{}")),
    Case(
        "invalid-then-valid",
        f"{BAD_BLOCK}\n{block('g', '{}')}",
        content=f"{BAD_BLOCK}\n",
        calls=(("g", "{}"),),
    ),
    Case("content-after-call", f"{WEATHER}\n\nDone.", content="Done.", calls=(WEATHER_CALL,)),
    Case(
        "unclosed-call",
        'Sure.\n<tool_call>\n{"name": "f", "argu',
        'Sure.\n<tool_call>\n{"name": "f", "argu',
    ),
    Case("partial-open-tag-at-end", "Hello <tool_ca", content="Hello <tool_ca"),
    Case(
        "llama-json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        calls=(("get_weather", '{"city": "Paris"}'),),
    ),
    Case(
        "llama-json-several",
        '\n  {"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}};',
        calls=(("a", '{"x": 1}'), ("b", "{}")),
    ),
    Case("llama-json-not-a-call", ' {"answer": 42}', content=' {"answer": 42}'),
    Case("llama-json-name-only", '{"name": "Bob"}', content='{"name": "Bob"}'),
    Case("llama-json-trailing-text", f"{LLAMA} and more", content=f"{LLAMA} and more"),
    Case("llama-json-incomplete", '{"name": "f", "parameters": {', '{"name": "f", "parameters": {'),
    Case("llama-json-mid-content", f"Here: {LLAMA}", content=f"Here: {LLAMA}"),
    Case("llama-json-tools-off", LLAMA, content=LLAMA, flags={"reasoning": True, "tools": False}),
    Case(
        "llama-json-after-think",
        '<think>\nuse a tool\n</think>\n\n{"name": "f", "parameters": {"a": [1, 2]}}',
        reasoning="use a tool\n",
        calls=(("f", '{"a": [1, 2]}'),),
    ),
    Case("whitespace-only", "  \n", content="  \n"),
]


@dataclass(frozen=True)
class Outcome:
    content: str
    reasoning: str
    calls: tuple[tuple[str, str], ...]
    ids: tuple[str, ...]


def parse(chunks: list[str], flags: dict[str, bool]) -> Outcome:
    parser = OutputParser(**flags)
    deltas = [parser.feed(chunk) for chunk in chunks]
    deltas.append(parser.finish())
    total = merge(deltas)
    ids, names, arguments = [], [], []
    for delta in total.tool_calls:
        if delta.id is not None:  # the first delta of a call
            assert delta.index == len(ids), "calls must be numbered 0, 1, … in order"
            assert CALL_ID.fullmatch(delta.id) and delta.name
            ids.append(delta.id)
            names.append(delta.name)
            arguments.append("")
        assert 0 <= delta.index < len(ids)
        arguments[delta.index] += delta.arguments
    assert len(set(ids)) == len(ids)
    assert parser.num_tool_calls == len(ids)
    assert parser.tool_calls() == [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
        for i, n, a in zip(ids, names, arguments, strict=True)
    ]
    for text in arguments:
        json.loads(text)  # every emitted arguments string is JSON
    calls = tuple(zip(names, arguments, strict=True))
    return Outcome(total.content, total.reasoning, calls, tuple(ids))


def expected(case: Case) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    return case.content, case.reasoning, case.calls


def observed(outcome: Outcome) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    return outcome.content, outcome.reasoning, outcome.calls


def random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks, pos = [], 0
    while pos < len(text):
        size = rng.choice((0, 1, 1, 2, 3, 5, 8, 13))
        chunks.append(text[pos : pos + size])
        pos += size
    return chunks


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_whole_text(case: Case) -> None:
    assert observed(parse([case.text], case.flags)) == expected(case)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_split_at_every_boundary(case: Case) -> None:
    for cut in range(len(case.text) + 1):
        chunks = [case.text[:cut], case.text[cut:]]
        assert observed(parse(chunks, case.flags)) == expected(case), f"split at {cut}"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_one_character_at_a_time(case: Case) -> None:
    assert observed(parse(list(case.text), case.flags)) == expected(case)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_random_chunks(case: Case) -> None:
    rng = random.Random(case.id)
    for _ in range(25):
        chunks = random_chunks(case.text, rng)
        assert observed(parse(chunks, case.flags)) == expected(case), chunks


def test_plain_text_is_held_only_while_it_may_be_a_tag() -> None:
    parser = OutputParser(reasoning=True, tools=True)
    assert parser.feed("Hello wor") == ParsedDelta(content="Hello wor")
    assert parser.feed("ld <") == ParsedDelta(content="ld ")
    assert parser.feed("t") == ParsedDelta()  # "<t" may begin <think> or <tool_call>
    assert parser.feed("o") == ParsedDelta()
    assert parser.feed("p") == ParsedDelta(content="<top")
    assert parser.finish() == ParsedDelta()


def test_reasoning_streams_before_the_block_closes() -> None:
    parser = OutputParser(reasoning=True, tools=False, starts_in_reasoning=True)
    assert parser.feed("\n") == ParsedDelta()  # a redundant <think> may still follow
    assert parser.feed("First, ") == ParsedDelta(reasoning="First, ")
    assert parser.feed("add.</") == ParsedDelta(reasoning="add.")
    assert parser.feed("think>\n") == ParsedDelta()
    assert parser.feed("\n4") == ParsedDelta(content="4")


def test_a_call_is_emitted_when_its_block_closes() -> None:
    parser = OutputParser(reasoning=False, tools=True)
    assert parser.feed("Checking.\n<tool_call>\n") == ParsedDelta(content="Checking.\n")
    assert parser.feed('{"name": "get_weather", "arguments": {"city"') == ParsedDelta()
    assert parser.feed(': "Paris"}}\n</tool_call') == ParsedDelta()
    assert parser.num_tool_calls == 0 and parser.tool_calls() == []
    delta = parser.feed(">")
    assert delta.content == "" and delta.reasoning == ""
    (call,) = delta.tool_calls
    assert CALL_ID.fullmatch(call.id)
    assert (call.index, call.name, call.arguments) == (0, "get_weather", '{"city": "Paris"}')
    assert parser.num_tool_calls == 1
    assert parser.tool_calls()[0]["id"] == call.id
    assert parser.finish() == ParsedDelta()


def test_many_calls_have_unique_ids_and_consecutive_indices() -> None:
    text = "\n".join(block(f"f{n}", f'{{"n": {n}}}') for n in range(6))
    parser = OutputParser(reasoning=True, tools=True)
    deltas = [parser.feed(text), parser.finish()]
    calls = merge(deltas).tool_calls
    assert [call.index for call in calls] == list(range(6))
    assert len({call.id for call in calls}) == 6
    assert [json.loads(c["function"]["arguments"]) for c in parser.tool_calls()] == [
        {"n": n} for n in range(6)
    ]


def test_llama_json_is_held_until_finish() -> None:
    parser = OutputParser(reasoning=True, tools=True)
    assert parser.feed('  {"name": "f", ') == ParsedDelta()
    assert parser.feed('"parameters": {"a": 1}}') == ParsedDelta()
    assert parser.num_tool_calls == 0
    (call,) = parser.finish().tool_calls
    assert (call.index, call.name, call.arguments) == (0, "f", '{"a": 1}')


def test_content_is_not_held_when_it_does_not_start_with_a_brace() -> None:
    parser = OutputParser(reasoning=False, tools=True)
    assert parser.feed(" \n") == ParsedDelta()  # may still be Llama 3 JSON
    assert parser.feed("Sure {") == ParsedDelta(content=" \nSure {")


def test_finish_is_final() -> None:
    parser = OutputParser(reasoning=False, tools=False)
    assert parser.feed("a") == ParsedDelta(content="a")
    assert parser.finish() == ParsedDelta()
    assert parser.finish() == ParsedDelta()
    with pytest.raises(RuntimeError):
        parser.feed("b")


def test_openai_shapes() -> None:
    first = ToolCallDelta(index=1, id="call_" + "0" * 24, name="f", arguments="")
    more = ToolCallDelta(index=1, id=None, name=None, arguments='{"a": 1}')
    assert first.as_openai() == {
        "index": 1,
        "id": "call_" + "0" * 24,
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert more.as_openai() == {"index": 1, "function": {"arguments": '{"a": 1}'}}


def test_merge_and_is_empty() -> None:
    call = ToolCallDelta(index=0, id="call_" + "1" * 24, name="f", arguments="{}")
    parts = [
        ParsedDelta(reasoning="r"),
        ParsedDelta(content="a", tool_calls=(call,)),
        ParsedDelta(),
    ]
    assert merge(parts) == ParsedDelta(content="a", reasoning="r", tool_calls=(call,))
    assert ParsedDelta().is_empty and not parts[0].is_empty
