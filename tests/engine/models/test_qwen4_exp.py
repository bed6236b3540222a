"""Qwen4-Exp against transformers on tiny random configs: query-sparse attention whose budget
(16 tokens, blocks of 4) most contexts overflow, two or three hyper-connection streams, PLE
layers over hashed n-gram tables mapped from the checkpoint. Greedy tokens and logits equal
transformers' for a mixed batch with chunked prefill over block boundaries; a prefix hit
restores a snapshot of the recurrent and PLE states; preemption, n-gram verify rows and world
2 keep the tokens; the indexer's selection equals transformers' and matters; one-token prompts
start from a fresh state whatever their slot held."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM
from dgpp.engine.errors import ConfigError
from dgpp.engine.evaluation.teacher_force import teacher_forced_logits
from dgpp.engine.layers.qsa import QsaIndexer
from tests.conftest import build_tiny_checkpoint
from tests.engine.models.test_qwen3_5 import NEW_TOKENS, _check_parity, _greedy, _prompts
from tests.engine.parity import hf_greedy, max_logit_difference

ARCH = "Qwen4ExpForCausalLM"
KNOBS = dict(block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen4"), tokenizer_dir, ARCH)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> torch.nn.Module:
    return _hf(checkpoint)


def _hf(checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def test_greedy_tokens_and_logits_match_transformers(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    llm = LLM(str(checkpoint), **KNOBS)
    runner = llm.engine.runner
    # One attention layer: its KV, then its indexer's raw keys; the backends it reads.
    shapes = [tuple(pool.shape) for pool in runner.kv_caches]
    assert shapes == [(1, 2, 512, 4, 2, 32), (1, 512, 4, 16)]
    assert [backend.name for backend in runner.backends] == ["sparse-cpu-paged", "linear-state"]
    _check_parity(llm, hf_model)
    manager = llm.engine.block_manager
    assert manager.num_used_blocks == 0
    assert manager.states is not None
    assert manager.states.slots.num_free == llm.engine.config.max_concurrency


def test_sigmoid_gates_and_three_streams_match_transformers(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Sigmoid output gates on the linear layers, three streams, PLE on the second layer."""
    overrides = {"output_gate_type": "sigmoid", "hc_count": 3, "ple_layer_ids": [2]}
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, ARCH, **overrides)
    _check_parity(LLM(str(checkpoint), **KNOBS), _hf(checkpoint))


def test_the_selection_drops_tokens_that_matter(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    """Guards the parity: with an unlimited budget (dense attention) the logits of a 40-token
    prompt move past the tolerance."""
    llm = LLM(str(checkpoint), **KNOBS)
    prompt = _prompts()[3]
    continuation = hf_greedy(hf_model, prompt, 4)
    assert max_logit_difference(llm, hf_model, prompt, continuation) < 1e-3
    for module in llm.engine.runner.model.modules():
        if isinstance(module, QsaIndexer):
            module.dims = dataclasses.replace(module.dims, budget=10_000)
    assert max_logit_difference(llm, hf_model, prompt, continuation) > 1e-2


def test_selected_tokens_equal_transformers(checkpoint: Path, hf_model: torch.nn.Module) -> None:
    """The indexer on random hidden states of 50 tokens (one prefill row): every query's
    selected tokens are those transformers' indexer's mask keeps."""
    from dgpp.engine.backends.base import BatchLayout, BatchRow

    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=64, kv_capacity=256, seed=0)
    model = llm.engine.runner.model
    attention = model.model.layers[3].self_attn
    hf_indexer = hf_model.model.layers[3].self_attn.indexer
    seq = 50
    hidden = torch.randn(seq, 64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(seq)
    with torch.inference_mode():
        cos, sin = hf_model.model.rotary_emb(
            hidden[None], positions.view(1, 1, -1).expand(3, 1, -1)
        )
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
        mask = hf_indexer(hidden[None], (cos, sin), causal, None)[0, 0]  # [S, S]
        backend = attention.indexer.keys.backend
        layout = BatchLayout((BatchRow(0, seq, tuple(range(1, 14))),), 0, 4, False)
        metadata = {backend.name: backend.prepare(layout)}
        angles = model.model.rotary.lookup(positions, hidden.dtype)
        selection = attention.indexer(hidden, angles, metadata)
    assert selection is not None
    for query in range(seq):
        got = set(selection.positions[query][selection.valid[query]].tolist())
        assert got == set(mask[query].nonzero().squeeze(1).tolist()), f"query {query}"
    assert selection.valid.sum(dim=1).max() == 16 + 3  # four blocks and a tail of three


def test_prefix_hit_restores_the_recurrent_and_ple_states(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    """A second turn extends the first: it restores the snapshot at the first prompt's last
    full block (GDN and PLE states, n-gram context included) and computes the rest."""
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=7, prefix_min_tokens=8)
    engine = llm.engine
    system = list(range(500, 521))
    first = system + [7, 8, 9, 10, 11, 12]

    def run(prompt: list[int]) -> list[int]:
        request = engine.add_request(prompt, _greedy(8), cache_hints=(len(system),))
        while engine.has_unfinished():
            engine.step()
        assert request.output_token_ids == hf_greedy(hf_model, prompt, 8)
        return request.output_token_ids

    reply = run(first)
    run(first + reply + [40, 41, 42])
    assert engine.block_manager.states.snapshots.stats().hits == 1
    assert engine.counters.prefix_cache.hit_tokens == 24


def test_preemption_and_partly_right_drafts(checkpoint: Path, hf_model: torch.nn.Module) -> None:
    """A pool too small for every request (preempted ones recomputed), then verify rows of
    drafts right up to a varying depth (the hybrid tests' oracle; random weights repeat too
    rarely for n-gram drafts), which roll the GDN and PLE states back: transformers' tokens."""
    from tests.engine.speculative.test_hybrid_speculative import OracleProposer, _full

    prompts = [list(range(300, 340)), [5, 6, 7], list(range(1000, 1013)), [9, 4, 9, 4, 9, 4, 9]]
    llm = LLM(str(checkpoint), **{**KNOBS, "kv_capacity": 104, "max_model_len": 100})
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _greedy())]
    assert llm.engine.counters.num_preemptions > 0
    assert outputs == [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in prompts]
    llm = LLM(str(checkpoint), **KNOBS, speculative="ngram")
    llm.engine.scheduler.proposer = OracleProposer(_full(prompts, outputs))
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _greedy())] == outputs
    spec = llm.engine.counters.spec_decode
    assert 0 < spec.accepted_tokens < spec.draft_tokens


def test_one_token_prompts_start_fresh(checkpoint: Path, hf_model: torch.nn.Module) -> None:
    """A one-token prompt is a decode row from position 0; its state slot, used before, must
    not leak the earlier request's state into it."""
    engine = LLM(str(checkpoint), **KNOBS).engine
    for prompt in ([4000], [30000], [4000], [30000, 5]):
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
        (_, logits), *_ = teacher_forced_logits(engine, prompt, [])
        assert (logits[: expected.shape[0]] - expected).abs().max() < 1e-4, prompt


def test_world_of_two_equals_world_of_one(checkpoint: Path) -> None:
    from tests.engine.distributed.test_tensor_parallel import KNOBS as TP_KNOBS
    from tests.engine.distributed.test_tensor_parallel import _check_world_of_two

    _check_world_of_two(checkpoint, TP_KNOBS)


def test_mtp_is_refused_by_name(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="does not build Qwen4ExpForCausalLM's MTP layers"):
        LLM(str(checkpoint), kv_capacity=256, speculative="mtp")
