"""Structured outputs in the engine: masks in the batched sampler, a grammar that holds with
speculative decoding on (drafts are checked against it: output equals plain decoding), and
requests without a grammar that pay nothing (real weights of the default model)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from dgpp.engine.llm import LLM
from dgpp.engine.sampling.grammar import Grammars, json_schema_grammar, mask_rows
from dgpp.engine.sampling.sampling_params import SamplingParams

# A schema whose answers repeat themselves, so the n-gram drafter has something to propose.
LIST = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                "required": ["id", "ok"],
                "additionalProperties": False,
            },
            "minItems": 6,
            "maxItems": 6,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def _prompt(llm: LLM, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def pair(default_checkpoint: Path) -> tuple[LLM, LLM]:
    knobs = {"kv_capacity": 4096, "num_threads": 2}
    return (
        LLM(str(default_checkpoint), **knobs),
        LLM(str(default_checkpoint), speculative="ngram", spec_depth=5, **knobs),
    )


def test_speculative_output_equals_plain_output_under_a_grammar(pair: tuple[LLM, LLM]) -> None:
    plain, spec = pair
    grammar = json_schema_grammar(LIST, "schema")
    prompt = _prompt(plain, "List six items with ids as JSON.")
    params = SamplingParams(max_tokens=200, temperature=0, grammar=grammar)
    (expected,) = plain.generate([prompt], params)
    (drafted,) = spec.generate([prompt], params)
    assert drafted.outputs[0].token_ids == expected.outputs[0].token_ids
    jsonschema.validate(json.loads(expected.outputs[0].text), LIST)
    counters = spec.engine.stats().counters.spec_decode
    assert counters.draft_tokens > 0 and counters.accepted_tokens > 0  # drafts were checked


def test_a_batch_mixes_constrained_and_free_requests(pair: tuple[LLM, LLM]) -> None:
    plain, _ = pair
    grammar = json_schema_grammar(LIST, "schema")
    prompt = _prompt(plain, "List six items with ids as JSON.")
    free = SamplingParams(max_tokens=20, temperature=0)
    alone = plain.generate([prompt], free)[0].outputs[0].token_ids
    mixed = plain.generate(
        [prompt, prompt], [free, SamplingParams(max_tokens=200, temperature=0, grammar=grammar)]
    )
    assert mixed[0].outputs[0].token_ids == alone  # the free row is not masked
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), LIST)


def test_requests_without_a_grammar_pay_nothing(default_checkpoint: Path) -> None:
    llm = LLM(str(default_checkpoint), kv_capacity=1024, num_threads=2)
    llm.generate([_prompt(llm, "hi")], SamplingParams(max_tokens=4, temperature=0))
    assert llm.engine.grammars._tokenizer is None  # llguidance's tokenizer was never built
    logits = torch.randn(3, 16)
    before = logits.clone()
    mask_rows(logits, [None, None, None])
    assert torch.equal(logits, before)


def test_masks_allow_only_what_the_grammar_allows(default_checkpoint: Path) -> None:
    llm = LLM(str(default_checkpoint), kv_capacity=1024, num_threads=2)
    grammars: Grammars = llm.engine.grammars
    matcher = grammars.matcher(json_schema_grammar({"enum": ["yes", "no"]}, "schema"))
    logits = torch.zeros(2, grammars.vocab_size)
    mask_rows(logits, [matcher, None])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    texts = {llm.tokenizer.decode([token]) for token in allowed}
    assert texts and all('"yes"'.startswith(t) or '"no"'.startswith(t) for t in texts), texts
    assert torch.isfinite(logits[1]).all()
