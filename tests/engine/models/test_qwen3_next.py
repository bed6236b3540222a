"""Qwen3-Next (Gated DeltaNet + gated attention + MoE) against transformers' PyTorch fallback on
a tiny random config: greedy tokens of a mixed batch with prefill chunks crossing blocks, the
logits, prefix hits that restore a recurrent-state snapshot, preemption and resume, aborts that
free the state slot, and world 2 equal to world 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.planning.memory_plan import plan_memory
from dgpp.engine.planning.state_plan import engine_state_layout
from dgpp.engine.server.metrics import prometheus
from dgpp.engine.server.metrics.service import ServiceCounters, ServiceMetrics
from dgpp.engine.server.routes.metrics_routes import metrics_body
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import hf_greedy, max_logit_difference

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("qwen3-next")
    # layer 1 dense among MoE layers; the full-attention layer is the last of four
    return build_tiny_checkpoint(out, tokenizer_dir, "Qwen3NextForCausalLM", mlp_only_layers=[1])


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in (1, 5, 13, 40)]


def _greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_greedy_tokens_and_logits_match_transformers(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    prompts = _prompts()
    outputs = llm.generate(prompts, _greedy())  # one batch: decodes beside prefill chunks
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == expected, f"prompt of {len(prompt)} tokens"
    assert len({token for o in outputs for token in o.outputs[0].token_ids}) > 20
    worst = max(
        max_logit_difference(llm, hf_model, prompt, hf_greedy(hf_model, prompt, 6))
        for prompt in prompts[1:4]
    )
    assert worst < 1e-3, worst
    manager = llm.engine.block_manager
    assert manager.num_used_blocks == 0
    assert manager.states is not None
    assert manager.states.slots.num_free == llm.engine.config.max_concurrency


def test_prefix_hits_restore_snapshots_and_continue(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    """A second turn extends the first turn's prompt and reply; a third shares only the
    "system prompt" hint. Each hit restores the deepest snapshot and computes the rest."""
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=7, prefix_min_tokens=8)
    engine = llm.engine
    system = list(range(500, 521))  # 21 tokens: the hint snapshots after 20
    first = system + [7, 8, 9, 10, 11, 12]  # 27 tokens: the prompt's last full block ends at 24

    def run(prompt: list[int], hint: int | None = None) -> list[int]:
        hints = (hint,) if hint is not None else ()
        request = engine.add_request(prompt, _greedy(8), cache_hints=hints)
        while engine.has_unfinished():
            engine.step()
        tokens = request.output_token_ids
        assert tokens == hf_greedy(hf_model, prompt, 8), f"prompt of {len(prompt)} tokens"
        return tokens

    reply = run(first, hint=len(system))
    snapshots = engine.block_manager.states.snapshots
    assert snapshots.stats().held == 2  # after 20 (the hint) and 24 (the prompt's last block)
    second = first + reply + [40, 41, 42]
    run(second, hint=len(system))
    stats = snapshots.stats()
    assert stats.hits == 1 and stats.hits_by_depth == {6: 1}  # 24 tokens restored
    third = system + [90, 91, 92, 93, 94]  # only the system prompt is shared
    run(third, hint=len(system))
    stats = snapshots.stats()
    assert stats.hits == 2 and stats.hits_by_depth[5] == 1  # 20 tokens restored
    assert engine.counters.prefix_cache.hit_tokens == 24 + 20
    assert engine.block_manager.states.slots.num_free == engine.config.max_concurrency
    # what /metrics reports of them
    body = metrics_body(engine.stats(), ServiceCounters())["prefix_cache"]["state_snapshots"]
    assert body["hits"] == 2 and body["hits_by_depth_tokens"] == {"20": 1, "24": 1}
    assert body["held"] == stats.held and body["bytes"] == stats.held * snapshots.slot_bytes
    registry = prometheus.build_registry(ServiceMetrics(), lambda: "tiny", engine.stats)
    text = prometheus.render(registry).decode()
    assert "dgpp:state_snapshot_hits_total" in text and "dgpp:state_snapshots{" in text


def test_a_shared_prefix_is_snapshotted_where_prompts_branch(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    """No hint: the second prompt sharing a 24-token prefix with the first finds its KV but no
    snapshot there, computes it and snapshots the branch point; the third restores it."""
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=64, prefix_min_tokens=8)
    shared = list(range(700, 724))
    for tail in ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]):
        prompt = shared + tail
        got = llm.generate([prompt], _greedy(6))[0].outputs[0].token_ids
        assert list(got) == hf_greedy(hf_model, prompt, 6)
    stats = llm.engine.block_manager.states.snapshots.stats()
    assert stats.hits_by_depth == {6: 1}  # the third prompt only
    assert llm.engine.counters.prefix_cache.hit_tokens == 24


def test_no_snapshot_no_hit(checkpoint: Path, hf_model: torch.nn.Module) -> None:
    """Below `prefix_min_tokens` nothing is snapshotted: cached KV blocks alone cannot serve a
    recurrent layer, so a repeated prompt is computed again (and still right)."""
    llm = LLM(str(checkpoint), block_size=4, prefix_min_tokens=0, prefix_cache_gib=0.0)
    prompt = list(range(600, 630))
    for _ in range(2):
        got = llm.generate([prompt], _greedy(6))[0].outputs[0].token_ids
        assert list(got) == hf_greedy(hf_model, prompt, 6)
    assert llm.engine.counters.prefix_cache.hit_tokens == 0


def test_preemption_recomputes_and_resumes(checkpoint: Path, hf_model: torch.nn.Module) -> None:
    # 20 blocks of 4 for four requests of up to 60 tokens: the newest are preempted and return
    llm = LLM(str(checkpoint), block_size=4, kv_capacity=80, prefill_chunk_tokens=16)
    prompts = _prompts()
    outputs = llm.generate(prompts, _greedy(20))
    assert llm.engine.counters.num_preemptions > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 20)
    assert llm.engine.block_manager.states.slots.num_free == llm.engine.config.max_concurrency


def test_abort_frees_the_state_slot(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), block_size=4, max_concurrency=2)
    engine = llm.engine
    request = engine.add_request(list(range(100, 120)), _greedy(50))
    engine.step()
    assert request.state_slot >= 0
    assert engine.block_manager.states.slots.num_free == 1
    engine.abort(request.request_id)
    engine.step()
    assert engine.block_manager.states.slots.num_free == 2
    assert request.state_slot == -1


def test_memory_plan_counts_states_and_snapshots(checkpoint: Path) -> None:
    model = ModelConfig.from_checkpoint(checkpoint)
    config = EngineConfig(model=str(checkpoint), max_concurrency=8, prefix_cache_gib=0.001)
    layout = engine_state_layout(config, model, 1)
    # 3 linear layers x (conv: 3 x (2*2*16 + 4*16) + state: 4 x 16 x 16) float32
    assert layout.slot_bytes == 3 * (3 * 128 + 4 * 16 * 16) * 4
    assert layout.num_running == 8
    assert layout.num_snapshots == (1 << 30) // 1000 // layout.slot_bytes
    plan = plan_memory(config, model, 1)
    assert plan.state_bytes == layout.total_bytes
    assert "states" in plan.describe()
    off = EngineConfig(model=str(checkpoint), max_concurrency=8, prefix_cache=False)
    assert engine_state_layout(off, model, 1).num_snapshots == 0
    two = engine_state_layout(config, model, 2)  # each rank holds half the heads
    assert two.slot_bytes * 2 == layout.slot_bytes


def test_world_of_two_equals_world_of_one(checkpoint: Path) -> None:
    """Linear-attention key heads (and their value heads, conv channels, A_log/dt_bias) split
    across ranks, states held per rank for its heads."""
    from tests.engine.distributed.test_tensor_parallel import (
        KNOBS,
        PRESSURE,
        PROMPTS,
        _check_world_of_two,
    )

    _check_world_of_two(checkpoint, KNOBS)
    _check_world_of_two(checkpoint, PRESSURE)
    # A second wave extends the first's prompts: world 2 restores the snapshots every rank
    # saved of its own heads' states (world 1 computes them without the cache).
    longer = [prompt + [77, 78, 79] for prompt in PROMPTS]
    hits = _check_world_of_two(checkpoint, {**KNOBS, "prefix_min_tokens": 8}, (PROMPTS, longer))
    assert hits >= 40 + 12  # the 40- and 13-token prompts' last full blocks
