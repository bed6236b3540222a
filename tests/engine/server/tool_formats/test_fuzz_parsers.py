"""hypothesis over the output parsers: arbitrary model text, fed whole and in arbitrary chunks.

The recorded cases of each format (test_tool_format_*.py, test_output_parser.py) check what a
parse yields; here the text is arbitrary, drawn from every format's markup mixed with JSON
fragments and noise, so half-open tags, nested and stray markers and broken arguments are the
norm. For every format and option set: parsing never raises, the call deltas are well formed
(`format_cases.parse` checks ids and indices), and any chunking yields what the whole text does.
Budget `DGPP_FUZZ_EXAMPLES` (default 200) per test, derandomized.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.engine.server.parsers.reasoning_parser import ReasoningSplitter
from dgpp.engine.server.parsers.special_tokens import SpecialTokenText
from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.tool_formats.output_format import ToolFormat
from tests.engine.server.format_cases import parse
from tests.engine.server.fuzz_checks import fuzz_examples

FUZZ = settings(max_examples=fuzz_examples(200), derandomize=True, deadline=None)
MARKUP = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function", "```json\n", "```",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<function=", "</function>", "<parameter=", "</parameter>", ">",
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
    "<|constrain|>", "assistant", "analysis", "final", "commentary", " to=functions.",
    '{"name": "ls", "arguments": {"path": "/tmp"}}', '{"name": "ls", "parameters": {}}',
    '{"name": ', '"arguments": ', "{", "}", "[", "]", '"', ",", ":", "ls", "path", "\n", " ",
    "<|im_end|>", "<|endoftext|>",
)  # fmt: skip
TEXT = st.lists(st.sampled_from(MARKUP) | st.text(max_size=4), max_size=24).map("".join)
SCHEMAS = ToolSchemas({"ls": {"path": {"type": "string"}, "depth": {"type": "integer"}}})
SPECIAL = SpecialTokenText(["<|im_end|>", "<|endoftext|>", "<|im_start|>"])
OPTIONS = st.fixed_dictionaries(
    {
        "tool_format": st.sampled_from(list(ToolFormat)),
        "reasoning": st.booleans(),
        "tools": st.booleans(),
        "starts_in_reasoning": st.booleans(),
        "special_tokens": st.sampled_from([None, SPECIAL]),
    }
).map(lambda options: {**options, "schemas": SCHEMAS})


@st.composite
def chunkings(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


@FUZZ
@given(data=st.data(), text=TEXT, options=OPTIONS)
def test_output_parser_chunked_equals_whole(
    data: st.DataObject, text: str, options: dict[str, Any]
) -> None:
    whole = parse([text], options)
    assert parse(data.draw(chunkings(text)), options) == whole
    assert parse(list(text), options) == whole


@FUZZ
@given(data=st.data(), text=TEXT, starts_in_reasoning=st.booleans())
def test_reasoning_splitter_chunked_equals_whole(
    data: st.DataObject, text: str, starts_in_reasoning: bool
) -> None:
    def split(chunks: list[str]) -> tuple[str, str]:
        splitter = ReasoningSplitter(starts_in_reasoning=starts_in_reasoning)
        parts = [*(splitter.feed(chunk) for chunk in chunks), splitter.finish()]
        return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)

    reasoning, content = split([text])
    assert split(data.draw(chunkings(text))) == (reasoning, content)
    # Nothing is invented: what comes out is the input less tags and layout newlines.
    assert len(reasoning) + len(content) <= len(text)
