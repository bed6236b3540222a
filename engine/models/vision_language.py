"""The Qwen vision-language checkpoints with their images: Qwen3-VL and Qwen3-VL-MoE
(`Qwen3VL…ForConditionalGeneration`: the Qwen3 / Qwen3-MoE decoder with interleaved M-RoPE and
DeepStack features added after its first layers), and the vision tower Qwen3.5 and
Qwen3.5-MoE (`models.qwen3_5`) attach the same way.

The encoder (`dgpp.engine.vision.qwen_vision`) sits at `model.visual` (`models.vision_tower`);
the language model's weights come from `model.language_model.*`. The runner finds the encoder
through `vision_encoder` and hands the decoder each step's image tokens
(`dgpp.engine.vision.step_vision.VisionInputs`).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.moe import Experts, expert_target
from dgpp.engine.models.llama import LlamaForCausalLM
from dgpp.engine.models.moe_blocks import moe_mlp
from dgpp.engine.models.moe_config import qwen3_moe_spec
from dgpp.engine.models.qwen3_5 import take_stacked_experts
from dgpp.engine.models.vision_tower import attach_vision, vision_encoder, vl_checkpoint_name

# Qwen3-VL's text rotary when the config names no sections (transformers' default)
QWEN3_VL_SECTION = (24, 20, 20)


def with_default_section(config: ModelConfig) -> ModelConfig:
    """Qwen3-VL's config with its M-RoPE sections (transformers' default when absent)."""
    if config.rope.mrope_section is not None:
        return config
    return replace(config, rope=replace(config.rope, mrope_section=QWEN3_VL_SECTION))


class Qwen3VLForCausalLM(LlamaForCausalLM):
    """`Qwen3VLForConditionalGeneration`: Qwen3 with images. Its MoE sibling's experts are
    stored stacked (released checkpoints: transposed, gate_up [E, H, 2I] and down [E, I, H])."""

    checkpoint_name = staticmethod(vl_checkpoint_name)
    vision_encoder = property(vision_encoder)

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        super().__init__(with_default_section(config), parallel, max_position, attention)
        attach_vision(self, config)
        for module in self.modules():
            if isinstance(module, Experts):
                take_stacked_experts(module, transposed=True)


class Qwen3VLMoeForCausalLM(Qwen3VLForCausalLM):
    """`Qwen3VLMoeForConditionalGeneration`: Qwen3-MoE with images; its router always
    renormalises the top k."""

    checkpoint_target = staticmethod(expert_target)

    @staticmethod
    def build_mlp(
        config: ModelConfig, parallel: ParallelContext, index: int, prefix: str
    ) -> nn.Module:
        spec = qwen3_moe_spec(config.raw)
        spec = replace(spec, router=replace(spec.router, norm_topk_prob=True))
        return moe_mlp(config, parallel, spec, index, prefix)
