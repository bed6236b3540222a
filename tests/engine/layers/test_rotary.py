"""RoPE scaling variants against transformers' own initialisation functions."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.layers.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies

VARIANTS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
]


@pytest.mark.parametrize("scaling", VARIANTS, ids=lambda v: (v or {}).get("rope_type", "default"))
def test_inverse_frequencies_match_transformers(scaling: dict | None) -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    if scaling is not None:
        raw["rope_scaling"] = dict(scaling)
    hf_config = LlamaConfig(**raw)
    rope_type = (scaling or {}).get("rope_type", "default")
    hf_inv_freq, hf_scaling = (
        ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        if (rope_type != "default")
        else (1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64)), 1.0)
    )
    ours, attention_factor = inverse_frequencies(ModelConfig.from_dict(raw).rope, 64)
    torch.testing.assert_close(ours, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(hf_scaling)


def test_apply_rotary_matches_rotate_half_reference() -> None:
    rope = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        }
    ).rope
    rotary = RotaryEmbedding(16, 64, rope)
    positions = torch.tensor([0, 5, 63])
    x = torch.randn(3, 2, 16)
    inv_freq, _ = inverse_frequencies(rope, 16)
    angles = positions[:, None].float() * inv_freq[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :]
    rotated_half = torch.cat((-x[..., 8:], x[..., :8]), -1)
    expected = x * cos + rotated_half * sin
    torch.testing.assert_close(apply_rotary(x, rotary.lookup(positions, x.dtype)), expected)
