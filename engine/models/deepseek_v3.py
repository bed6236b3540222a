"""DeepSeek-V3 (and Kimi K2, the same architecture): multi-head latent attention (`layers.mla`,
its cache the compressed latent) in every layer; a dense MLP in the first
`first_k_dense_replace` layers and a mixture of experts in the others.

Tensor-parallel layout: attention as `layers.mla` describes (heads split, latent replicated),
MLPs as Llama's and experts as `layers.moe`'s, the embedding and LM head vocabulary-parallel.
The multi-token-prediction layers a checkpoint may carry (`num_nextn_predict_layers`, stored
as `model.layers.{N}.*` for N >= num_hidden_layers) are not built; the loader skips them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.backends.mla_base import MLABackend
from dgpp.engine.cache_spec import CacheSpec
from dgpp.engine.config import ModelConfig
from dgpp.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from dgpp.engine.layers.mla import MLADims, MultiHeadLatentAttention
from dgpp.engine.layers.moe import expert_target
from dgpp.engine.layers.norm import RMSNorm
from dgpp.engine.layers.rotary import RopeAngles, RotaryEmbedding
from dgpp.engine.models.glm4_moe import grouped_moe_block
from dgpp.engine.parallel import ParallelContext


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: MLABackend,
        layer_index: int,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_index}"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(config, parallel, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Dense below `first_k_dense_replace`, else sigmoid-routed, group-limited experts plus
        # shared experts: the GLM-4.5 block.
        self.mlp = grouped_moe_block(config, parallel, layer_index, f"{prefix}.mlp")

    def forward(
        self,
        angles: RopeAngles,
        hidden: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(angles, self.input_layernorm(hidden), metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekV3Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: MLABackend,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            parallel,
            config.weight_formats.packed(["model.embed_tokens"]),
        )
        # Rope covers only the `qk_rope_head_dim` dims of each query head and the shared key.
        self.rotary = RotaryEmbedding(
            MLADims.of(config).qk_rope_head_dim, max_position, config.rope
        )
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, parallel, attention, index)
            for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        angles = self.rotary.lookup(positions, hidden.dtype)  # looked up once for every layer
        for layer in self.layers:
            hidden = layer(angles, hidden, metadata)
        return self.norm(hidden)


class DeepseekV3ForCausalLM(nn.Module):
    """Causal LM head over `DeepseekV3Model`; `attention` is an MLA backend
    (`dgpp.engine.backends.selection.select_backend_for` picks one for MLA checkpoints)."""

    checkpoint_target = staticmethod(expert_target)  # routed experts, stacked at load
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: MLABackend,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config, parallel, max_position, attention)
        head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            parallel,
            config.weight_formats.packed([head]),
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """One latent cache per layer, the same on every rank (see `LlamaForCausalLM`)."""
        return [MLADims.of(config).cache_spec] * config.num_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Logits [N, padded_vocab] for hidden [N, hidden]; `dtype` overrides the compute dtype."""
        return self.lm_head.compute_logits(hidden, dtype)
