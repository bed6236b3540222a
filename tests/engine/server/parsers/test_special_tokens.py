"""SpecialTokenFilter: special-token text leaves a stream, whatever its chunking."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.engine.server.parsers.special_tokens import SpecialTokenFilter, SpecialTokenText

SPECIAL = SpecialTokenText(["<|end|>", "<|endoftext|>", "<|start|>", "<｜tool▁sep｜>"])
# Pathological on purpose: one text is a prefix of another, one starts inside another's end.
TANGLED = SpecialTokenText(["<|a|>", "<|a|>b", "|>x", "aa", "a"])
PIECES = [
    "<|",
    "end",
    "|>",
    "oftext",
    "<|start|>",
    "<",
    "|",
    "x",
    "a",
    "b",
    "<｜",
    "tool▁sep｜>",
    " ",
]


def filtered(special: SpecialTokenText, chunks: list[str]) -> str:
    stream = SpecialTokenFilter(special)
    return "".join(stream.feed(chunk) for chunk in chunks) + stream.finish()


def test_strips_whole_tokens_and_keeps_lookalikes() -> None:
    text = "a<|end|>b<|endoftext|>c <|en d <|start| <｜tool▁sep｜>"
    assert SPECIAL.strip(text) == "abc <|en d <|start| "
    assert filtered(SPECIAL, [text]) == "abc <|en d <|start| "


def test_holds_only_what_may_become_a_token() -> None:
    stream = SpecialTokenFilter(SPECIAL)
    assert stream.feed("Hello <|e") == "Hello "
    assert stream.feed("nd") == ""
    assert stream.feed("|>!") == "!"
    assert stream.feed("<|endo") == ""
    assert stream.feed("ops") == "<|endoops"
    assert stream.feed("<") == ""
    assert stream.finish() == "<"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.data())
def test_any_chunking_strips_as_the_whole_text(pieces: list[str], data: Any) -> None:
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    for special in (SPECIAL, TANGLED):
        assert filtered(special, chunks) == special.strip(text), (special.texts, chunks)


def test_of_reads_the_tokenizer(tokenizer: Any) -> None:
    special = SpecialTokenText.of(tokenizer)
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= special.texts
    assert "<think>" not in special.texts


def test_no_special_tokens_is_a_pass_through() -> None:
    assert filtered(SpecialTokenText([]), ["a<", "|end|>"]) == "a<|end|>"
