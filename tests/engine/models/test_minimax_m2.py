"""MiniMax-M2 against transformers on tiny random configs: QK norm over the whole projection,
partial rotary, the biased sigmoid router, Mixtral-style expert names. Greedy tokens of a mixed
batch in prefill chunks, the logits, a prefix-cache hit, and world 2 equal to world 1 with the
key heads split and with one key head held by both ranks (the norm's sums must count it once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.models.minimax_m2 import minimax_checkpoint_name
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import check_batch_matches_transformers, hf_greedy

NEW = 12
TINY = dict(
    num_local_experts=8,
    num_experts_per_tok=2,
    intermediate_size=32,
    head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
SHAPES = {"kv-split": {}, "kv-shared": {"num_key_value_heads": 1}}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    out = tmp_path_factory.mktemp(f"minimax-m2-{request.param}")
    overrides = {**TINY, **SHAPES[request.param]}
    return build_tiny_checkpoint(out, tokenizer_dir, "MiniMaxM2ForCausalLM", **overrides)


def _greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_greedy_tokens_and_logits_match_transformers(checkpoint: Path) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in (1, 5, 13, 40)]
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    check_batch_matches_transformers(llm, hf_model, prompts, NEW)
    shared = list(range(500, 530))  # a prefix-cache hit gives the same tokens
    cached = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=16, prefix_min_tokens=0)
    for suffix in ([7, 8, 9], [11, 12]):
        prompt = shared + suffix
        got = cached.generate([prompt], _greedy(8))[0].outputs[0].token_ids
        assert list(got) == hf_greedy(hf_model, prompt, 8)
    assert cached.engine.counters.prefix_cache.hit_tokens >= 28


def test_world_of_two_equals_world_of_one(checkpoint: Path) -> None:
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    _check_world_of_two(checkpoint, KNOBS)


def test_released_names() -> None:
    assert (
        minimax_checkpoint_name("model.layers.3.block_sparse_moe.experts.7.w1.weight")
        == "model.layers.3.mlp.experts.7.gate_proj.weight"
    )
    assert minimax_checkpoint_name("model.layers.0.block_sparse_moe.experts.0.w3.weight").endswith(
        "experts.0.up_proj.weight"
    )
    assert minimax_checkpoint_name("model.layers.0.block_sparse_moe.experts.0.w2.weight").endswith(
        "experts.0.down_proj.weight"
    )
    assert (
        minimax_checkpoint_name("model.layers.1.block_sparse_moe.e_score_correction_bias")
        == "model.layers.1.mlp.gate.e_score_correction_bias"
    )
    assert minimax_checkpoint_name("model.layers.1.block_sparse_moe.gate.weight").endswith(
        ".mlp.gate.weight"
    )
    assert minimax_checkpoint_name("model.layers.1.self_attn.q_norm.weight").endswith(
        "q_norm.weight"
    )
