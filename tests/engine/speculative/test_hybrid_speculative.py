"""Speculative decoding on hybrid models (Qwen3-Next, Qwen3.5, Kimi-Linear, MiMo-V2-Flash's
windowed layers, DeepSeek-V4): a verify row keeps its recurrent state after each position in
draft slots, and a rejected draft rolls the state back to the last accepted token. Drafts that
are partly right (an oracle proposer: the plain run's next tokens with one wrong at a varying
depth) exercise every rollback depth; the output is plain decoding's, cold, under pool pressure
(preempted requests recomputed), through prefix hits that restore a state snapshot, with stop
strings and logprobs, and at world 2 with the n-gram proposer."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.planning.state_plan import engine_state_layout
from dgpp.engine.scheduling.request import Request
from dgpp.engine.speculative.ngram import NgramProposer
from tests.conftest import build_tiny_checkpoint
from tests.engine.models.test_deepseek_v4 import TINY as DEEPSEEK_V4
from tests.engine.models.test_kimi_linear import TINY as KIMI
from tests.engine.models.test_mimo_v2_flash import TINY as MIMO
from tests.engine.speculative.mtp_checks import partly_right

PROMPTS = [
    [5, 17, 99, 3, 42],
    list(range(100, 137)),
    [7, 8, 9] * 6,
    [300 + i % 5 for i in range(9)],
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
KNOBS = dict(kv_capacity=512, block_size=4, prefill_chunk_tokens=16, prefix_min_tokens=8)
FAMILIES = {"qwen3-next": ("Qwen3NextForCausalLM", {"mlp_only_layers": [1]}),
            "qwen3.5-moe": ("Qwen3_5MoeForCausalLM", {}),
            # windowed layers' keys and values kept as a state (layers/window_kv.py)
            "mimo-v2-flash": ("MiMoV2FlashForCausalLM", MIMO),
            "kimi-linear": ("KimiLinearForCausalLM", KIMI),
            # every layer's window and compressor carries a state, compressed keys paged
            "deepseek-v4": ("DeepseekV4ForCausalLM", DEEPSEEK_V4)}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, request: pytest.FixtureRequest
) -> Path:
    architecture, overrides = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    return build_tiny_checkpoint(out, tokenizer_dir, architecture, **overrides)


class OracleProposer:
    """Drafts the plain run's next tokens, `depth` of them, with the token at depth
    (position % (depth + 1)) made wrong: every accepted count from 0 to `depth` occurs."""

    def __init__(self, full: dict[tuple[int, ...], list[int]], depth: int = 4) -> None:
        self.full, self.depth = full, depth
        self.proposed = 0

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        sequence = self.full[tuple(request.prompt_token_ids)]
        known = request.num_tokens
        wrong = known % (self.depth + 1)
        draft = partly_right(sequence, known, min(self.depth, limit), wrong)
        self.proposed += bool(draft)
        return draft


def _plain(checkpoint: Path, prompts: list[list[int]], **knobs: object) -> list[tuple[int, ...]]:
    llm = LLM(str(checkpoint), **{**KNOBS, "prefix_cache": False, **knobs})
    return [tuple(out.outputs[0].token_ids) for out in llm.generate(prompts, GREEDY)]


def _speculative(checkpoint: Path, full: dict, **knobs: object) -> tuple[LLM, OracleProposer]:
    llm = LLM(str(checkpoint), speculative="ngram", **{**KNOBS, **knobs})
    oracle = OracleProposer(full)
    llm.engine.scheduler.proposer = oracle
    return llm, oracle


def _full(prompts: list[list[int]], outputs: list[tuple[int, ...]]) -> dict:
    return {tuple(p): [*p, *out] for p, out in zip(prompts, outputs, strict=True)}


def test_partly_right_drafts_change_nothing(checkpoint: Path) -> None:
    plain = _plain(checkpoint, PROMPTS)
    llm, oracle = _speculative(checkpoint, _full(PROMPTS, plain))
    got = [tuple(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY)]
    assert got == plain
    engine = llm.engine
    spec = engine.counters.spec_decode
    assert oracle.proposed > 8 and 0 < spec.accepted_tokens < spec.draft_tokens
    # every rollback depth happened: some drafts wholly rejected, some wholly accepted
    assert spec.accepted_per_position[0] < spec.drafts and spec.accepted_per_position[3] > 0
    states = engine.block_manager.states
    assert states is not None and states.slots.num_free == engine.config.max_concurrency
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_the_ngram_knob_is_taken_on_hybrid_models(checkpoint: Path) -> None:
    """No longer refused: the n-gram proposer drafts (random weights repeat too rarely for its
    drafts to be tested here; the oracle's verify rows above are the same rows) and every
    running slot has its draft slots."""
    plain = _plain(checkpoint, PROMPTS[:2])
    llm = LLM(str(checkpoint), speculative="ngram", spec_depth=3, **KNOBS)
    assert [tuple(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:2], GREEDY)] == plain
    engine = llm.engine
    assert isinstance(engine.scheduler.proposer, NgramProposer)
    assert (engine.stats().speculative, engine.stats().spec_depth) == ("ngram", 3)
    assert engine.runner.state_layout.draft_depth == 3


def test_seeded_sampling_with_penalties_is_unchanged(checkpoint: Path) -> None:
    """The oracle drafts the plain seeded run's tokens (one wrong at a varying depth): each
    position is drawn with the request's own generator and penalties, as plain decoding draws."""
    params = SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.9, seed=11, repetition_penalty=1.2,
        ignore_eos=True,
    )  # fmt: skip
    plain = LLM(str(checkpoint), **{**KNOBS, "prefix_cache": False})
    expected = [tuple(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, params)]
    llm, _ = _speculative(checkpoint, _full(PROMPTS, expected))
    assert [tuple(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)] == expected
    spec = llm.engine.counters.spec_decode
    assert 0 < spec.accepted_tokens < spec.draft_tokens


@pytest.mark.parametrize("pool", [64, 1024], ids=["preempting", "prefix-hits"])
def test_pool_pressure_and_snapshot_hits_change_nothing(checkpoint: Path, pool: int) -> None:
    """Verify rows beside preemption (a preempted request's pending rollback is dropped with
    its slot), and a second turn that restores the snapshot taken at its prompt's last block."""
    plain = _plain(checkpoint, PROMPTS, kv_capacity=pool)
    full = _full(PROMPTS, plain)
    turn_two = [*full[tuple(PROMPTS[1])], 7, 8, 9]
    if pool == 1024:
        again = _plain(checkpoint, [turn_two], kv_capacity=pool)[0]
        full[tuple(turn_two)] = [*turn_two, *again]
    llm, _ = _speculative(checkpoint, full, kv_capacity=pool)
    engine = llm.engine
    assert [tuple(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert engine.counters.spec_decode.accepted_tokens > 0
    assert (engine.counters.num_preemptions > 0) == (pool == 64)
    if pool == 1024:
        assert tuple(llm.generate([turn_two], GREEDY)[0].outputs[0].token_ids) == again
        states = engine.block_manager.states
        assert states is not None and states.snapshots.stats().hits >= 1
        assert engine.counters.prefix_cache.hit_tokens >= 36
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_stop_strings_and_logprobs_are_unchanged(checkpoint: Path) -> None:
    plain = LLM(str(checkpoint), **KNOBS)
    tokens = plain.generate(PROMPTS[1:2], GREEDY)[0].outputs[0]
    llm, _ = _speculative(checkpoint, _full(PROMPTS[1:2], [tuple(tokens.token_ids)]))
    stop = tokens.text[len(tokens.text) // 2 :][:3]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=16, stop=(stop,)),
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=2),
    ):
        mine = llm.generate(PROMPTS[1:2], params)[0].outputs[0]
        ref = plain.generate(PROMPTS[1:2], params)[0].outputs[0]
        assert (mine.token_ids, mine.text, mine.finish_reason) == (
            ref.token_ids, ref.text, ref.finish_reason,
        )  # fmt: skip
        if params.logprobs:
            assert mine.logprobs is not None and ref.logprobs is not None
            for got, want in zip(mine.logprobs, ref.logprobs, strict=True):
                assert got.token_id == want.token_id
                assert got.logprob == pytest.approx(want.logprob, abs=1e-3)


def test_draft_slots_are_counted(checkpoint: Path) -> None:
    model = ModelConfig.from_checkpoint(checkpoint)
    base = dict(model=str(checkpoint), max_concurrency=8, prefix_cache=False)
    off = engine_state_layout(EngineConfig(**base), model, 1)
    on = engine_state_layout(EngineConfig(**base, speculative="ngram", spec_depth=3), model, 1)
    assert (off.num_draft_slots, on.num_draft_slots) == (0, 24)
    assert on.total_bytes == off.total_bytes * 4
    assert on.draft_slot(7, 2) == on.num_slots - 1


def _oracle_rank(full: dict, *args: object) -> None:
    """A rank of `_check_world_of_two` whose rank 0 drafts with the oracle."""
    import dgpp.engine.engine as engine_module
    from tests.engine.distributed.test_tensor_parallel import _rank

    engine_module.NgramProposer = lambda *_: OracleProposer(full)  # type: ignore[assignment]
    _rank(*args)  # type: ignore[arg-type]


def test_world_of_two_verifies_on_every_rank(checkpoint: Path) -> None:
    """Each rank keeps its own heads' states per draft position and rolls back alike."""
    from tests.engine.distributed import test_tensor_parallel as tp

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # tp's
    outputs = LLM(str(checkpoint), **tp.KNOBS).generate(tp.PROMPTS, params)
    full = _full(tp.PROMPTS, [tuple(out.outputs[0].token_ids) for out in outputs])
    knobs = {**tp.KNOBS, "speculative": "ngram"}
    tp._check_world_of_two(checkpoint, knobs, target=functools.partial(_oracle_rank, full))
