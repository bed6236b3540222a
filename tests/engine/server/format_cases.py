"""Recorded-output cases for the tool-call formats, and the check that any chunking of a case's
text gives the same content, reasoning and tool calls as feeding it whole."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from dgpp.engine.server.tool_formats.output_parser import OutputParser, merge

# dgpp's own ids, or the ids a format writes itself (Kimi K2: functions.NAME:INDEX)
CALL_ID = re.compile(r"call_[0-9a-f]{24}|(functions\.)?[^\s:]+:\d+")
Calls = tuple[tuple[str, Any], ...]  # (name, decoded arguments) in index order


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    content: str = ""
    reasoning: str = ""
    calls: Calls = ()
    options: dict[str, Any] = field(default_factory=dict)  # OutputParser keyword arguments


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # harmony passes a body that is not JSON through as it is


def parse(chunks: list[str], options: dict[str, Any]) -> tuple[str, str, Calls]:
    """`(content, reasoning, calls)` of the chunks fed in order, checking the call deltas."""
    parser = OutputParser(**options)
    total = merge([*(parser.feed(chunk) for chunk in chunks), parser.finish()])
    ids, names, arguments = [], [], []
    for delta in total.tool_calls:
        assert delta.id is not None and CALL_ID.fullmatch(delta.id) and delta.name
        assert delta.index == len(ids), "calls must be numbered 0, 1, … in order"
        ids.append(delta.id)
        names.append(delta.name)
        arguments.append(delta.arguments)
    assert len(set(ids)) == len(ids) and parser.num_tool_calls == len(ids)
    assert [call["id"] for call in parser.tool_calls()] == ids
    calls = tuple((name, _decoded(args)) for name, args in zip(names, arguments, strict=True))
    return total.content, total.reasoning, calls


def expected(case: Case) -> tuple[str, str, Calls]:
    return case.content, case.reasoning, case.calls


def check_every_split(case: Case) -> None:
    """Whole, cut in two at every offset, and one character at a time."""
    assert parse([case.text], case.options) == expected(case)
    for cut in range(len(case.text) + 1):
        chunks = [case.text[:cut], case.text[cut:]]
        assert parse(chunks, case.options) == expected(case), f"split at {cut}"
    assert parse(list(case.text), case.options) == expected(case)


@st.composite
def chunked(draw: st.DrawFn, cases: list[Case]) -> tuple[Case, list[str]]:
    """A case and its text cut at random offsets."""
    case = draw(st.sampled_from(cases))
    cuts = sorted(draw(st.lists(st.integers(0, len(case.text)), max_size=16)))
    bounds = [0, *cuts, len(case.text)]
    return case, [case.text[a:b] for a, b in itertools.pairwise(bounds)]
