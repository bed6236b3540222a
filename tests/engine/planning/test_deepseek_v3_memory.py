"""The latent cache in the memory plan: DeepSeek-V3 layers declare `MLALatentSpec`s, the plan
counts latent bytes (the same on every rank), and the runner's pools are exactly that size."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dgpp.engine.backends.cache_spec import MLALatentSpec, allocate_caches, cache_layers
from dgpp.engine.backends.torch_mla import TorchMLAAttention
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.models.registry import build_model
from dgpp.engine.planning.memory_plan import DeviceMemory, plan_memory, rank_cache_specs

GIB = 1 << 30
PLENTY = DeviceMemory(4096 * GIB, 4096 * GIB, "test host", is_accelerator=False)
# DeepSeek-V3's config.json, as far as the cache and the plan read it.
REAL: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "tie_word_embeddings": False,
}
TINY: dict[str, Any] = {
    **REAL,
    "vocab_size": 1001,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "first_k_dense_replace": 3,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 256,
}


def _expanded_bytes_per_token(raw: dict[str, Any], tp_size: int, itemsize: int) -> int:
    """What a cache of expanded per-head keys (nope + rope) and values would take per token
    on one rank: the form transformers caches before its latent cache, and vLLM's without MLA."""
    heads = raw["num_attention_heads"] // tp_size
    key = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    return raw["num_hidden_layers"] * heads * (key + raw["v_head_dim"]) * itemsize


@pytest.mark.parametrize("tp_size", [1, 2, 8])
def test_deepseek_v3_latent_bytes_per_token(tp_size: int) -> None:
    model = ModelConfig.from_dict(REAL)
    specs = rank_cache_specs(model, tp_size, tp_rank=tp_size - 1)
    assert specs == [MLALatentSpec(512, 64)] * 61  # replicated: every rank caches all of it
    latent = sum(spec.bytes_per_token(torch.bfloat16) for spec in specs)
    assert latent == 61 * (512 + 64) * 2 == 70_272
    expanded = _expanded_bytes_per_token(REAL, tp_size, 2)
    assert expanded == 4_997_120 // tp_size
    config = EngineConfig(model="deepseek-v3", dtype="bfloat16", kv_capacity=4096)
    plan = plan_memory(config, model, tp_size, PLENTY, tp_rank=tp_size - 1)
    assert plan.kv_bytes == 4096 * latent
    print(
        f"DeepSeek-V3 bf16 KV per token per rank at tp {tp_size}: latent {latent} B, expanded "
        f"{expanded} B ({expanded / latent:.1f}x); 4096-token pool {plan.kv_bytes / GIB:.3f} GiB"
        f" latent vs {4096 * expanded / GIB:.3f} GiB expanded"
    )
    assert expanded / latent == pytest.approx(71.1 / tp_size, rel=1e-3)


def test_runner_pools_equal_the_plans_latent_bytes() -> None:
    model = ModelConfig.from_dict(TINY)
    config = EngineConfig(model="tiny", kv_capacity=256, block_size=16)
    built = build_model(model, ParallelContext(), 256, TorchMLAAttention(torch.device("cpu")))
    layers = cache_layers(built)
    assert [layer.cache_spec for layer in layers] == rank_cache_specs(model, 1, 0)
    pools = allocate_caches(layers, config.num_kv_blocks, 16, torch.float32, torch.device("cpu"))
    assert [tuple(pool.shape) for pool in pools] == [(3, 16, 16, 24)]
    assert plan_memory(config, model, 1, PLENTY).kv_bytes == sum(pool.nbytes for pool in pools)
