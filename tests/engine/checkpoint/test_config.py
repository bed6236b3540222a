"""Parsing config.json into ModelConfig, and EngineConfig validation."""

from __future__ import annotations

import pytest

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.errors import ConfigError, ModelLoadError

BASE = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "eos_token_id": [5, 6],
}


def test_family_flags_and_fields() -> None:
    qwen3 = ModelConfig.from_dict(BASE)
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    assert qwen3.eos_token_ids == (5, 6)
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.qk_norm
    llama = ModelConfig.from_dict(
        {**BASE, "architectures": ["LlamaForCausalLM"], "head_dim": None, "eos_token_id": 2}
    )
    assert llama.head_dim == 16 and llama.eos_token_ids == (2,) and not llama.qkv_bias


def test_rope_from_transformers_4_and_5_spellings_agree() -> None:
    old = ModelConfig.from_dict(
        {
            **BASE,
            "rope_theta": 1e6,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        }
    )
    new = ModelConfig.from_dict(
        {
            **BASE,
            "rope_parameters": {
                "rope_theta": 1e6,
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        }
    )
    assert old.rope == new.rope and new.rope.theta == 1e6 and new.rope.rope_type == "yarn"


def test_unsupported_rope_and_missing_keys() -> None:
    with pytest.raises(ModelLoadError, match="longrope"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    broken = dict(BASE)
    del broken["hidden_size"]
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelConfig.from_dict(broken)
    with pytest.raises(ModelLoadError, match="architectures"):
        ModelConfig.from_dict({**BASE, "architectures": []})


def test_engine_config_limits() -> None:
    model = ModelConfig.from_dict(BASE)
    config = EngineConfig(model="m", kv_capacity=1000, block_size=16)
    assert config.num_kv_blocks == 63
    assert config.effective_max_model_len(model) == 1008  # the pool is the binding limit
    assert EngineConfig(model="m", kv_capacity=10**5).effective_max_model_len(model) == 4096
    with pytest.raises(ConfigError, match="max_model_len=5000 exceeds"):
        EngineConfig(model="m", kv_capacity=10**5, max_model_len=5000).effective_max_model_len(
            model
        )
    assert EngineConfig(model="m").resolved_dtype == "float32"
    assert EngineConfig(model="m", device="cuda").resolved_dtype == "bfloat16"
    for bad in (
        {"dtype": "int8"},
        {"kv_capacity": 0},
        {"max_concurrency": True},
        {"prefill_chunk_tokens": -1},
        {"num_threads": 0},
    ):
        with pytest.raises(ConfigError):
            EngineConfig(model="m", **bad)
