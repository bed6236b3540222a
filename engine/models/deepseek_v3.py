"""DeepSeek-V3 (and Kimi K2, the same architecture): multi-head latent attention (`layers.mla`,
its cache the compressed latent) in every layer; a dense MLP in the first
`first_k_dense_replace` layers and a mixture of experts in the others.

Tensor-parallel layout: attention as `layers.mla` describes (heads split, latent replicated),
MLPs as Llama's and experts as `layers.moe`'s, the embedding and LM head vocabulary-parallel.
The multi-token-prediction layers a checkpoint may carry (`num_nextn_predict_layers`, stored
as `model.layers.{N}.*` for N >= num_hidden_layers) are not built; the loader skips them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from dgpp.engine.backends.cache_spec import CacheSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.mla import MLADims, MultiHeadLatentAttention
from dgpp.engine.layers.moe import expert_target
from dgpp.engine.models.glm4_moe import grouped_moe_block
from dgpp.engine.models.llama import LlamaForCausalLM


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """The shared decoder with latent attention over an MLA backend
    (`dgpp.engine.backends.selection.select_backend_for` picks one for MLA checkpoints) and,
    below `first_k_dense_replace` dense, above it the GLM-4.5 block: sigmoid-routed,
    group-limited experts plus shared experts."""

    checkpoint_target = staticmethod(expert_target)  # routed experts, stacked at load
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    build_mlp = staticmethod(grouped_moe_block)

    @classmethod
    def build_attention(
        cls,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        index: int,
        prefix: str,
    ) -> nn.Module:
        del index, prefix
        return MultiHeadLatentAttention(config, parallel, attention)

    @staticmethod
    def rotary_dim(config: ModelConfig) -> int:
        """Rope covers only the `qk_rope_head_dim` dims of each query head and the shared key."""
        return MLADims.of(config).qk_rope_head_dim

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """One latent cache per layer, the same on every rank (see `LlamaForCausalLM`)."""
        return [MLADims.of(config).cache_spec] * config.num_layers
