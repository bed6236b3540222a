"""Builds a decoder layer's MLP for the mixture-of-experts families that share the Llama
decoder: dense where the family's `MoeSpec` says so, else a `SparseMoeBlock` whose routed
experts are stacked (dense checkpoints) or kept packed (quantized ones), plus shared experts."""

from __future__ import annotations

from contextvars import ContextVar

from torch import nn

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.moe import PackedExperts, SparseMoeBlock
from dgpp.engine.layers.moe_spec import MoeSpec
from dgpp.engine.models.llama import DecoderMLP

# Set while the weights are only counted (`dgpp.engine.planning.weight_count`, on the meta device):
# routed experts stored alike are then one module in every slot, counted once per slot, instead
# of hundreds of modules built (Qwen3-Next-80B-FP8: 24,624, 8 s a world on two cores).
COUNTING_ONLY: ContextVar[bool] = ContextVar("counting_only", default=False)


def packed_experts(
    config: ModelConfig, parallel: ParallelContext, spec: MoeSpec, prefix: str
) -> PackedExperts | None:
    """The routed experts as packed MLPs when the checkpoint quantized them, else None."""
    first = [f"{prefix}.experts.0.gate_proj", f"{prefix}.experts.0.up_proj"]
    if config.weight_format(first, config.hidden_size) is None:
        return None
    width = spec.intermediate_size
    count = spec.router.num_experts

    def stored(index: int) -> tuple[object, object]:
        name = f"{prefix}.experts.{index}"
        pair = [f"{name}.gate_proj", f"{name}.up_proj"]
        return (
            config.weight_format(pair, config.hidden_size),
            config.weight_format([f"{name}.down_proj"], width),
        )

    if COUNTING_ONLY.get():
        first = stored(0)
        if all(stored(index) == first for index in range(1, count)):
            alike = DecoderMLP(config, parallel, f"{prefix}.experts.0", width)
            return PackedExperts([alike] * count)
    return PackedExperts(
        [DecoderMLP(config, parallel, f"{prefix}.experts.{index}", width) for index in range(count)]
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
