"""Builds a decoder layer's MLP for the mixture-of-experts families that share the Llama
decoder: dense where the family's `MoeSpec` says so, else a `SparseMoeBlock` whose routed
experts are stacked (dense checkpoints) or kept packed (quantized ones), plus shared experts."""

from __future__ import annotations

from torch import nn

from dgpp.engine.config import ModelConfig
from dgpp.engine.layers.moe import PackedExperts, SparseMoeBlock
from dgpp.engine.layers.moe_spec import MoeSpec
from dgpp.engine.models.llama import DecoderMLP
from dgpp.engine.parallel import ParallelContext


def packed_experts(
    config: ModelConfig, parallel: ParallelContext, spec: MoeSpec, prefix: str
) -> PackedExperts | None:
    """The routed experts as packed MLPs when the checkpoint quantized them, else None."""
    first = [f"{prefix}.experts.0.gate_proj", f"{prefix}.experts.0.up_proj"]
    if config.weight_format(first, config.hidden_size) is None:
        return None
    width = spec.intermediate_size
    return PackedExperts(
        [
            DecoderMLP(config, parallel, f"{prefix}.experts.{index}", width)
            for index in range(spec.router.num_experts)
        ]
    )


def moe_mlp(
    config: ModelConfig, parallel: ParallelContext, spec: MoeSpec, index: int, prefix: str
) -> nn.Module:
    """Layer `index`'s MLP: dense, or routed experts plus `spec`'s shared experts."""
    if not spec.is_sparse(index):
        return DecoderMLP(config, parallel, prefix)
    shared = None
    if spec.shared_intermediate_size:
        shared = DecoderMLP(
            config, parallel, f"{prefix}.shared_experts", spec.shared_intermediate_size
        )
    packed = packed_experts(config, parallel, spec, prefix)
    return SparseMoeBlock(spec, config.hidden_size, parallel, shared, experts=packed)
