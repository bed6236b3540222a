"""Qwen3.5 and Qwen3.5-MoE: Qwen3-Next's hybrid decoder (`models.qwen3_next`) with the same
layer types, norms and gated attention, and these differences:

- Gated DeltaNet's input projections are stored separately (`in_proj_qkv`, `in_proj_z`,
  `in_proj_b`, `in_proj_a`, rows in the conv's [q | k | v] order and by value head) and load
  fused into the layer's `in_proj_qkvz` / `in_proj_ba` (`GatedDeltaNet(split=True)`);
- rotary is mRoPE (`mrope_section`): text positions are the same on every axis, where it is
  plain rotary on the first `partial_rotary_factor` of each head;
- Qwen3.5's MLP is dense SwiGLU in every layer; Qwen3.5-MoE's is sparse in every layer (no
  `mlp_only_layers` or `decoder_sparse_step`), its softmax router always renormalising the
  top k, with Qwen3-Next's sigmoid-gated shared expert;
- the released checkpoints are vision-language (`Qwen3_5ForConditionalGeneration`,
  `Qwen3_5MoeForConditionalGeneration`): the config's `text_config` read as the model's
  (`ModelConfig`), the language model's weights renamed from `model.language_model.*`, the
  vision tower (`model.visual.*`) attached and loaded as it is (`models.vision_tower`), the
  multi-token-prediction layers (`mtp.*`, built apart with `speculative: mtp`) skipped; their
  routed experts are stored stacked, `experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and
  `experts.down_proj` [E, H, I], beside the per-expert tensors transformers' `save_pretrained`
  writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.moe import Experts, SparseMoeBlock
from dgpp.engine.layers.moe_spec import MoeSpec
from dgpp.engine.models.llama import DecoderMLP, LlamaForCausalLM
from dgpp.engine.models.moe_blocks import packed_experts
from dgpp.engine.models.moe_config import qwen3_moe_spec
from dgpp.engine.models.qwen3_next import Qwen3NextForCausalLM
from dgpp.engine.models.vision_tower import attach_vision, vision_encoder, vl_checkpoint_name


def qwen3_5_checkpoint_name(name: str) -> str | None:
    """The model's name for a checkpoint tensor: a vision-language checkpoint's as its model's
    (`vl_checkpoint_name`); None for the MTP layers' (built apart)."""
    return None if name.startswith("mtp.") else vl_checkpoint_name(name)


def dense_mlp(config: ModelConfig, parallel: ParallelContext, index: int, prefix: str) -> nn.Module:
    del index
    return DecoderMLP(config, parallel, prefix)


def qwen3_5_moe_spec(raw: dict[str, Any]) -> MoeSpec:
    """Qwen3-MoE's spec, every layer sparse and the top-k weights renormalised (what
    transformers' Qwen3.5-MoE does whatever the config says)."""
    spec = qwen3_moe_spec(raw)
    router = dataclasses.replace(spec.router, norm_topk_prob=True)
    return dataclasses.replace(spec, router=router, dense_layers=frozenset(), sparse_step=1)


def qwen3_5_moe_mlp(
    config: ModelConfig, parallel: ParallelContext, index: int, prefix: str
) -> nn.Module:
    del index
    spec = qwen3_5_moe_spec(dict(config.raw))
    width = int(config.raw.get("shared_expert_intermediate_size") or 0)
    shared = DecoderMLP(config, parallel, f"{prefix}.shared_expert", width) if width else None
    experts = packed_experts(config, parallel, spec, prefix)
    return SparseMoeBlock(
        spec, config.hidden_size, parallel, shared, experts=experts, shared_gate=shared is not None
    )


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense MLPs); also serves `Qwen3_5ForConditionalGeneration` text-only."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        **LlamaForCausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj_qkvz", 0),
        "in_proj_z": ("in_proj_qkvz", 1),
        "in_proj_b": ("in_proj_ba", 0),
        "in_proj_a": ("in_proj_ba", 1),
    }
    checkpoint_name = staticmethod(qwen3_5_checkpoint_name)
    build_mlp = staticmethod(dense_mlp)
    split_projections = True
    vision_encoder = property(vision_encoder)
    serves_images = True  # attach the checkpoint's vision tower, if it has one

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        super().__init__(config, parallel, max_position, attention)
        if self.serves_images:
            attach_vision(self, config)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE; also serves `Qwen3_5MoeForConditionalGeneration` text-only."""

    build_mlp = staticmethod(qwen3_5_moe_mlp)

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        super().__init__(config, parallel, max_position, attention)
        for module in self.modules():
            if isinstance(module, Experts):
                self.adapt_experts(module)

    @staticmethod
    def adapt_experts(experts: Experts) -> None:
        take_stacked_experts(experts)


def take_stacked_experts(experts: Experts, transposed: bool = False) -> None:
    """Let `experts` load the stacked checkpoint tensors too (a call without a shard):
    gate_up [E, 2I, H] as each expert's gate (rows :I) and up (rows I:), down [E, H, I]
    (`transposed`: or stored [E, H, 2I] and [E, I, H], as the released Qwen3-VL-MoE
    checkpoints are, told apart by shape as transformers does); the per-expert tensors load as
    before."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    load_gate_up, load_down = experts.load_gate_up, experts.load_down
    width = experts.spec.intermediate_size

    def stacked_gate_up(
        param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int] | None = None
    ) -> None:
        if shard is not None:
            load_gate_up(param, loaded, shard)
            return
        shape = (experts.num_experts, 2 * width, param.shape[2])
        loaded = _upright(loaded, shape, transposed)
        _check_stacked(loaded, shape, "gate_up_proj")
        for expert in range(experts.num_experts):
            load_gate_up(param, loaded[expert, :width], (expert, 0))
            load_gate_up(param, loaded[expert, width:], (expert, 1))

    def stacked_down(
        param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int] | None = None
    ) -> None:
        if shard is not None:
            load_down(param, loaded, shard)
            return
        shape = (experts.num_experts, param.shape[1], width)
        loaded = _upright(loaded, shape, transposed)
        _check_stacked(loaded, shape, "down_proj")
        for expert in range(experts.num_experts):
            load_down(param, loaded[expert], (expert, 0))

    gate_up.weight_loader = stacked_gate_up  # type: ignore[attr-defined]
    down.weight_loader = stacked_down  # type: ignore[attr-defined]


def _upright(loaded: torch.Tensor, shape: tuple[int, ...], transposed: bool) -> torch.Tensor:
    """`loaded` in the [E, out, in] layout: as it is when its shape says so, else (where the
    family may store them transposed) its last two axes swapped."""
    if transposed and tuple(loaded.shape) != shape:
        return loaded.transpose(1, 2)
    return loaded


def _check_stacked(loaded: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(loaded.shape) != shape:
        raise ModelLoadError(
            f"experts.{name} of shape {tuple(loaded.shape)}, expected {shape} (stacked experts)"
        )
