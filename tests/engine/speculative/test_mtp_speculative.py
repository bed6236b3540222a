"""`speculative: mtp` on tiny DeepSeek-V3 and GLM-4.5 whose checkpoints carry an MTP layer:
the output is plain decoding's (greedy, and seeded sampling with penalties), whether the
layer's drafts are rejected (random weights) or accepted (an oracle draft pass standing in for a
trained layer), the KV pool returns to full, a world of two drafts with the sharded layer, and a
checkpoint without MTP layers is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.errors import ConfigError
from tests.conftest import build_tiny_checkpoint
from tests.engine.distributed.test_tensor_parallel import KNOBS as TP_KNOBS
from tests.engine.distributed.test_tensor_parallel import _check_world_of_two
from tests.engine.speculative.mtp_checkpoint import ARCH, FAMILIES, MOE, with_mtp_layer
from tests.engine.speculative.mtp_checks import check_mtp_memory_plan, oracle_draft_pass

PROMPTS = [[5, 17, 99, 3, 42], list(range(100, 137)), [7, 8, 9] * 6]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(
    max_tokens=12, temperature=0.9, top_p=0.9, seed=11, repetition_penalty=1.2, ignore_eos=True
)
KNOBS = dict(kv_capacity=512, block_size=8, prefill_chunk_tokens=16)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, request: pytest.FixtureRequest
) -> Path:
    architecture, overrides, _, _ = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(f"{request.param}-mtp")
    path = build_tiny_checkpoint(
        out, tokenizer_dir, architecture, num_nextn_predict_layers=1, **overrides
    )
    with_mtp_layer(path)
    return path


def _tokens(llm: LLM, params: SamplingParams) -> list[tuple[int, ...]]:
    return [tuple(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_mtp_drafts_change_nothing(checkpoint: Path, params: SamplingParams) -> None:
    plain = _tokens(LLM(str(checkpoint), **KNOBS), params)
    llm = LLM(str(checkpoint), speculative="mtp", **KNOBS)
    assert _tokens(llm, params) == plain
    engine = llm.engine
    stats = engine.stats()
    assert stats.counters.spec_decode.drafts > 0  # the drafts were verified
    assert (stats.speculative, stats.spec_depth) == ("mtp", 4)  # the knob's default depth
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_accepted_drafts_change_nothing(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every draft right (the plain run's next tokens, as many as the chained layer drafted):
    verify rows accept them, the KV and the MTP cache advance by several positions a step, and
    the output is still plain decoding's."""
    plain = _tokens(LLM(str(checkpoint), **KNOBS), GREEDY)
    full = {tuple(p): [*p, *out] for p, out in zip(PROMPTS, plain, strict=True)}
    llm = LLM(str(checkpoint), speculative="mtp", **KNOBS)
    engine = llm.engine
    oracle_draft_pass(monkeypatch, engine, full)
    assert _tokens(llm, GREEDY) == plain
    spec = engine.stats().counters.spec_decode
    assert spec.accepted_tokens > 0 and spec.accepted_tokens == spec.draft_tokens
    assert spec.draft_tokens > 2 * spec.drafts  # chained: several tokens a draft (depth 4)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


@pytest.mark.parametrize("pool", [100, 1024], ids=["preempting", "prefix-hits"])
def test_pool_pressure_and_prefix_hits_change_nothing(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, pool: int
) -> None:
    """With accepted drafts (the oracle: verify rows advance several positions a step): a pool
    too small for the batch (requests preempted and recomputed, the MTP cache catching up
    again), or a second turn that hits blocks written while verifying."""
    knobs = dict(kv_capacity=pool, block_size=4, prefill_chunk_tokens=16, prefix_min_tokens=0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(str(checkpoint), prefix_cache=False, **knobs)
    expected = [tuple(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, params)]
    full = {tuple(p): [*p, *out] for p, out in zip(PROMPTS, expected, strict=True)}
    turn_two = [*full[tuple(PROMPTS[1])], 7, 8, 9]
    again = plain.generate([turn_two], params)[0].outputs[0].token_ids
    full[tuple(turn_two)] = [*turn_two, *again]
    llm = LLM(str(checkpoint), speculative="mtp", **knobs)
    engine = llm.engine
    oracle_draft_pass(monkeypatch, engine, full)
    assert [tuple(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)] == expected
    assert engine.counters.spec_decode.accepted_tokens > 0
    assert (engine.counters.num_preemptions > 0) == (pool == 100)
    if pool == 1024:
        assert llm.generate([turn_two], params)[0].outputs[0].token_ids == again
        assert engine.counters.prefix_cache.hit_tokens >= len(PROMPTS[1]) + 16
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks  # cached: free


def test_stop_strings_max_tokens_and_logprobs_are_unchanged(checkpoint: Path) -> None:
    plain = LLM(str(checkpoint), **KNOBS)
    llm = LLM(str(checkpoint), speculative="mtp", **KNOBS)
    text = plain.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text
    for params in (
        SamplingParams(temperature=0.0, max_tokens=12, stop=(text[len(text) // 2 :][:3],)),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3),
    ):
        mine = llm.generate(PROMPTS[:1], params)[0].outputs[0]
        ref = plain.generate(PROMPTS[:1], params)[0].outputs[0]
        assert (mine.token_ids, mine.text, mine.finish_reason, mine.stop_reason) == (
            ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason,
        )  # fmt: skip
        if params.logprobs:
            assert mine.logprobs is not None and ref.logprobs is not None
            for got, want in zip(mine.logprobs, ref.logprobs, strict=True):
                assert got.token_id == want.token_id and got.rank == want.rank
                assert got.logprob == pytest.approx(want.logprob, abs=1e-3)


def test_world_of_two_drafts_with_its_sharded_mtp_layer(checkpoint: Path) -> None:
    """Both ranks run the MTP layer (its heads and experts split like a decoder layer's) on
    rank 0's draft messages; the world of two gives world one's plain tokens."""
    _check_world_of_two(checkpoint, {**TP_KNOBS, "speculative": "mtp"})


def test_int8_kv_drafts_in_a_world_of_two_as_plain_decoding_in_one(checkpoint: Path) -> None:
    """int8 KV (DeepSeek-V3's latents, GLM-4.5's paged keys and values; the MTP layer's cache
    too): verify rows read the quantized rows, and a world of two drafting gives world one's
    plain int8 tokens."""
    int8 = {**TP_KNOBS, "kv_cache_dtype": "int8"}
    _check_world_of_two(checkpoint, {**int8, "speculative": "mtp"}, reference_knobs=int8)


def test_the_memory_plan_counts_the_mtp_layer(checkpoint: Path) -> None:
    """Its KV pool (one more layer's) and its weights are in the plan, byte for byte."""
    check_mtp_memory_plan(checkpoint, **KNOBS)


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path: Path, tokenizer_dir: Path) -> None:
    plain = build_tiny_checkpoint(tmp_path, tokenizer_dir, ARCH, **MOE)
    with pytest.raises(ConfigError, match="multi-token-prediction layers"):
        LLM(str(plain), speculative="mtp", **KNOBS)
