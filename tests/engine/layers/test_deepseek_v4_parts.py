"""DeepSeek-V4's attention pieces against transformers: the interleaved rotary on each head's
trailing dims and its inverse (with both of V4's rope sets, the compressed layers' yarn
included, from dgpp's own rotary tables), and the grouped output projection, at world 1 and as
two ranks' partial sums."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as reference

from dgpp.engine.checkpoint.config import parse_rope
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.deepseek_v4_parts import GroupedOutputProjection, rotate_trailing_pairs
from dgpp.engine.layers.rotary import RotaryEmbedding

HEADS, HEAD_DIM, ROPE, HIDDEN = 4, 32, 8, 48
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}  # fmt: skip


def _config() -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        head_dim=HEAD_DIM,
        qk_rope_head_dim=ROPE,
        o_groups=2,
        o_lora_rank=8,
        num_hidden_layers=2,
        max_position_embeddings=2048,
        rope_parameters=YARN,
    )


@pytest.mark.parametrize("rope_type", ["main", "compress"])
def test_the_trailing_pairs_turn_as_transformers(rope_type: str) -> None:
    config = _config()
    theirs = reference.DeepseekV4RotaryEmbedding(config)
    positions = torch.tensor([0, 1, 5, 63, 200, 1500])
    x = torch.randn(1, positions.shape[0], HEADS, HEAD_DIM)
    cos, sin = theirs(x, positions[None], layer_type=rope_type)
    # dgpp's table from the same parameters (transformers nests them under "main"/"compress")
    params = config.rope_parameters[rope_type]
    rope = parse_rope({"rope_parameters": params, "max_position_embeddings": 2048})
    assert rope.rope_type == params["rope_type"]
    angles = RotaryEmbedding(ROPE, 2048, rope).lookup(positions, torch.float32)
    for inverse in (False, True):
        want = reference.apply_rotary_pos_emb(x, cos, -sin if inverse else sin, unsqueeze_dim=2)
        got = rotate_trailing_pairs(x[0], angles, inverse=inverse)
        torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
    back = rotate_trailing_pairs(rotate_trailing_pairs(x[0], angles), angles, inverse=True)
    torch.testing.assert_close(back, x[0], rtol=1e-5, atol=1e-5)


def _reference_projection(config: DeepseekV4Config) -> tuple[torch.nn.Module, torch.nn.Module]:
    width = HEADS * HEAD_DIM // config.o_groups
    o_a = reference.DeepseekV4GroupedLinear(
        width, config.o_groups * config.o_lora_rank, config.o_groups
    )
    o_b = torch.nn.Linear(config.o_groups * config.o_lora_rank, HIDDEN, bias=False)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in (o_a.weight, o_b.weight):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return o_a, o_b


def _ours(config: DeepseekV4Config, o_a, o_b, rank: int, world: int) -> GroupedOutputProjection:
    parallel = ParallelContext(tp_rank=rank, tp_size=world)
    ours = GroupedOutputProjection(
        HEADS, HEAD_DIM, config.o_groups, config.o_lora_rank, HIDDEN, parallel
    )
    ours.o_a_proj.weight.weight_loader(ours.o_a_proj.weight, o_a.weight.detach())
    ours.o_b_proj.weight.weight_loader(ours.o_b_proj.weight, o_b.weight.detach())
    return ours


def test_the_grouped_output_projection_equals_transformers() -> None:
    config = _config()
    o_a, o_b = _reference_projection(config)
    out = torch.randn(5, HEADS * HEAD_DIM)
    want = o_b(o_a(out.view(5, config.o_groups, -1)).flatten(1))
    torch.testing.assert_close(_ours(config, o_a, o_b, 0, 1)(out), want, rtol=1e-5, atol=1e-5)
    # two ranks, a group each: their partial sums (o_b_proj reduces; here by hand) add up
    halves = out.view(5, 2, -1)
    partial = []
    for rank in range(2):
        ours = _ours(config, o_a, o_b, rank, 2)
        ours.o_b_proj.parallel = ParallelContext()  # no all-reduce: the partial sum
        partial.append(ours(halves[:, rank].contiguous()))
    torch.testing.assert_close(partial[0] + partial[1], want, rtol=1e-5, atol=1e-5)
