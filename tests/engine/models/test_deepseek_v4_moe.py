"""DeepSeek-V4's mixture of experts against transformers' `DeepseekV4SparseMoeBlock` with the same
random weights: the sqrt(softplus) router choosing by score plus correction bias, the hash
router choosing by the token's row of `tid2eid`, clamped SwiGLU in the routed and the shared
experts (values past the limit included), at world 1."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as reference

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.activation import ClampedSiluAndMul
from dgpp.engine.layers.moe import SparseMoeBlock
from dgpp.engine.models.llama import DecoderMLP
from dgpp.engine.models.moe_config import deepseek_v4_moe_spec

H, INNER, E, VOCAB = 32, 16, 8, 100


def _config() -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=H,
        moe_intermediate_size=INNER,
        n_routed_experts=E,
        num_experts_per_tok=2,
        n_shared_experts=1,
        num_hidden_layers=4,
        routed_scaling_factor=1.5,
        swiglu_limit=1.0,  # small enough that the clamps act on these activations
    )


def _ours(config: DeepseekV4Config, layer: int, theirs: torch.nn.Module) -> SparseMoeBlock:
    raw = config.to_dict()
    raw["architectures"] = ["DeepseekV4ForCausalLM"]
    spec = deepseek_v4_moe_spec(raw, layer)
    model = ModelConfig.from_dict({**raw, "intermediate_size": INNER})
    parallel = ParallelContext()
    shared = DecoderMLP(model, parallel, "shared", spec.shared_intermediate_size)
    shared.act = ClampedSiluAndMul(spec.swiglu_limit)
    block = SparseMoeBlock(spec, H, parallel, shared)
    state = theirs.state_dict()
    with torch.no_grad():
        block.gate.weight.copy_(state["gate.weight"])
        if "gate.tid2eid" in state:
            block.gate.tid2eid.copy_(state["gate.tid2eid"])
        else:
            block.gate.e_score_correction_bias.copy_(state["gate.e_score_correction_bias"])
        block.experts.gate_up_proj.copy_(state["experts.gate_up_proj"])
        block.experts.down_proj.copy_(state["experts.down_proj"])
        gate_up = torch.cat((state["shared_experts.gate_proj.weight"],
                             state["shared_experts.up_proj.weight"]))  # fmt: skip
        shared.gate_up_proj.weight.copy_(gate_up)
        shared.down_proj.weight.copy_(state["shared_experts.down_proj.weight"])
    return block


@pytest.mark.parametrize("layer", [0, 3], ids=["hash", "scored"])
def test_the_block_equals_transformers(layer: int) -> None:
    config = _config()
    theirs = reference.DeepseekV4SparseMoeBlock(config, layer).float()
    generator = torch.Generator().manual_seed(layer)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        for name, buffer in theirs.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.randint(0, E, buffer.shape, generator=generator))
            else:
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    assert theirs.is_hash == (layer == 0)
    ours = _ours(config, layer, theirs)
    hidden = torch.randn(1, 9, H, generator=generator)
    ids = torch.randint(0, VOCAB, (1, 9), generator=generator)
    want = theirs(hidden, input_ids=ids)[0]
    torch.testing.assert_close(ours(hidden[0], ids[0]), want, rtol=1e-5, atol=1e-5)
