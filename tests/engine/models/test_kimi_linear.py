"""Kimi-Linear against transformers on tiny random configs: Kimi Delta Attention layers (a decay
per key channel, a state per request) beside latent-attention layers without rotary, over
DeepSeek-V3's MoE with a shared expert. Greedy tokens of a mixed batch in prefill chunks, the
logits, prefix hits through state snapshots, preemption, world 2 equal to world 1, and the
release's config.json spelling (`linear_attn_config`, numbered from 1) read as transformers'."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.backends.cache_spec import MLALatentSpec
from dgpp.engine.backends.state_cache import LinearStateSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.models.kimi_linear import KimiLinearForCausalLM, kimi_layer_types
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import (
    check_batch_matches_transformers,
    hf_greedy,
    random_prompts,
)

NEW = 12
TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
TINY = dict(
    num_hidden_layers=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    linear_head_dim=16,
    linear_num_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    layer_types=TYPES,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("kimi-linear")
    return build_tiny_checkpoint(out, tokenizer_dir, "KimiLinearForCausalLM", **TINY)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def _greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts() -> list[list[int]]:
    return random_prompts(9)


def test_greedy_tokens_and_logits_match_transformers(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    check_batch_matches_transformers(llm, hf_model, _prompts(), NEW)


def test_prefix_hits_restore_snapshots(checkpoint: Path, hf_model: torch.nn.Module) -> None:
    """The third prompt restores the snapshot the second saved where they branch; a next turn
    restores the one after the first prompt's last full block."""
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=16, prefix_min_tokens=8)

    def run(prompt: list[int]) -> list[int]:
        got = list(llm.generate([prompt], _greedy(8))[0].outputs[0].token_ids)
        assert got == hf_greedy(hf_model, prompt, 8)
        return got

    shared = list(range(500, 530))
    for suffix in ([7, 8, 9], [11, 12], [13, 14, 15]):
        run(shared + suffix)
    assert llm.engine.counters.prefix_cache.hit_tokens == 28
    first = list(range(900, 927))
    run(first + run(first) + [40, 41])
    assert llm.engine.counters.prefix_cache.hit_tokens == 28 + 24


def test_preempted_requests_resume_to_the_same_tokens(checkpoint: Path) -> None:
    prompts = _prompts()
    roomy = LLM(str(checkpoint), block_size=4, kv_capacity=2048, seed=0)
    tight = LLM(str(checkpoint), block_size=4, kv_capacity=80, prefill_chunk_tokens=8, seed=0)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, _greedy(20))]
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, _greedy(20))] == expected
    assert tight.engine.counters.num_preemptions > 0


def test_world_of_two_equals_world_of_one(checkpoint: Path) -> None:
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    _check_world_of_two(checkpoint, KNOBS)


def test_the_release_config_spelling(checkpoint: Path, tmp_path: Path) -> None:
    """The release's `linear_attn_config` (layers numbered from 1) and `first_k_dense_replace`
    in place of transformers' lists give the same model and tokens."""
    release = tmp_path / "release"
    shutil.copytree(checkpoint, release)
    config = json.loads((checkpoint / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads"):
        config.pop(key)
    config.pop("linear_conv_kernel_dim")
    config["first_k_dense_replace"] = 1
    config["mla_use_nope"] = True
    config["linear_attn_config"] = {
        "full_attn_layers": [3],
        "kda_layers": [1, 2, 4],
        "head_dim": 16,
        "num_heads": 4,
        "short_conv_kernel_size": 4,
    }
    (release / "config.json").write_text(json.dumps(config))
    assert kimi_layer_types(ModelConfig.from_checkpoint(release)) == TYPES
    prompts = _prompts()
    ours = LLM(str(checkpoint), block_size=4, seed=0).generate(prompts, _greedy())
    theirs = LLM(str(release), block_size=4, seed=0).generate(prompts, _greedy())
    assert [o.outputs[0].token_ids for o in theirs] == [o.outputs[0].token_ids for o in ours]


def test_cache_and_state_specs(checkpoint: Path) -> None:
    config = ModelConfig.from_checkpoint(checkpoint)
    for tp_size in (1, 2):
        parallel = ParallelContext(tp_rank=tp_size - 1, tp_size=tp_size)
        assert KimiLinearForCausalLM.cache_specs(config, parallel) == [MLALatentSpec(32, 8)]
        local = 4 // tp_size
        state = LinearStateSpec(3 * local * 16, 4, local, 16, 16)
        assert KimiLinearForCausalLM.state_specs(config, parallel) == [state] * 3
