"""Mixture-of-experts families against transformers on tiny random configs: greedy tokens
(mixed prompt lengths in one batch, prefill chunks crossing blocks), the prefix-cache hit path,
the router's expert choice, and world 2 equal to world 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.layers.moe_spec import MoeSpec
from dgpp.engine.layers.router import Router
from dgpp.engine.models.moe_config import (
    gpt_oss_moe_spec,
    grouped_moe_spec,
    qwen3_moe_spec,
)
from tests.conftest import build_tiny_checkpoint, tiny_model
from tests.engine.parity import hf_greedy, max_logit_difference

NEW_TOKENS = 16
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        # layer 1 dense among sparse ones; renormalised top-k
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            head_dim=16,
        ),
    ),
    "qwen3-moe-step2": (
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            head_dim=16,
        ),
    ),
    "glm4-moe": (
        "Glm4MoeForCausalLM",
        # first layer dense, 2 groups of 4 experts (1 kept), shared expert, partial rotary,
        # q/k/v biases, QK norm, a scaling factor
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            routed_scaling_factor=2.5,
        ),
    ),
    "glm4-moe-4groups": (
        "Glm4MoeForCausalLM",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=0,
            n_group=4,
            topk_group=2,
            head_dim=32,
            norm_topk_prob=False,
        ),
    ),
    "gpt-oss": (
        "GptOssForCausalLM",
        # sliding (window 8) and full layers alternating, sinks, biases, YaRN, clamped SwiGLU;
        # prompts up to 40 tokens cross the window in prefill chunks and decode
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in (1, 5, 13, 40)]


def _checkpoint(tmp_path: Path, tokenizer_dir: Path, family: str) -> Path:
    architecture, overrides = FAMILIES[family]
    return build_tiny_checkpoint(tmp_path / family, tokenizer_dir, architecture, **overrides)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_match_transformers(tmp_path: Path, tokenizer_dir: Path, family: str) -> None:
    checkpoint = _checkpoint(tmp_path, tokenizer_dir, family)
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)  # one batch: prompts of mixed lengths together
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == expected, f"prompt of {len(prompt)} tokens"
    assert len({token for o in outputs for token in o.outputs[0].token_ids}) > 20
    worst = max(
        max_logit_difference(llm, hf_model, prompt, hf_greedy(hf_model, prompt, 6))
        for prompt in prompts[1:4]
    )
    print(f"{family}: max |logit difference| = {worst:.2e}")
    assert worst < 1e-3
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("family", ["qwen3-moe", "glm4-moe", "gpt-oss"])
def test_prefix_cache_hits_give_the_same_tokens(
    tmp_path: Path, tokenizer_dir: Path, family: str
) -> None:
    checkpoint = _checkpoint(tmp_path, tokenizer_dir, family)
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=16, prefix_min_tokens=0)
    shared = list(range(500, 530))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for suffix in ([7, 8, 9], [7, 8, 9], [11, 12]):  # a whole-prompt hit, then a shared prefix
        prompt = shared + suffix
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert list(got) == hf_greedy(hf_model, prompt, 10)
    assert llm.engine.counters.prefix_cache.hit_tokens >= 2 * 28


def _router_spec(family: str) -> MoeSpec:
    architecture, overrides = FAMILIES[family]
    if architecture.startswith("GptOss"):
        return gpt_oss_moe_spec(overrides)
    return (qwen3_moe_spec if architecture.startswith("Qwen3") else grouped_moe_spec)(overrides)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_router_choice_equals_transformers(family: str) -> None:
    architecture, overrides = FAMILIES[family]
    hf_model = tiny_model(architecture, **overrides)
    spec = _router_spec(family)
    layer = next(i for i in range(3) if spec.is_sparse(i))
    mlp = hf_model.model.layers[layer].mlp
    hf_router = mlp.router if architecture.startswith("GptOss") else mlp.gate
    router = Router(spec.router, 64)
    router.load_state_dict(dict(hf_router.state_dict()), strict=True)
    hidden = torch.randn(257, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weights, ids = router(hidden)
        hf_weights, hf_ids = hf_router(hidden)[-2:]
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.float().gather(1, hf_order))


@pytest.mark.parametrize("family", ["qwen3-moe", "glm4-moe", "gpt-oss"])
def test_world_of_two_equals_world_of_one(tmp_path: Path, tokenizer_dir: Path, family: str) -> None:
    """Experts split on their intermediate dimension, router replicated, one all-reduce per
    MoE block (shared experts joined into it)."""
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    _check_world_of_two(_checkpoint(tmp_path, tokenizer_dir, family), KNOBS)
