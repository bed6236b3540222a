"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`): DeepSeek-V3's decoder (latent
attention, sigmoid-routed group-limited experts after the first dense layers) with DeepSeek
Sparse Attention in every layer (`layers.dsa`): a lightning indexer picks the `index_topk`
tokens each query attends to, from a key cache of its own.

GLM-5 differs in two ways: its indexer ropes interleaved pairs (DeepSeek-V3.2's: halves), and
its "shared" layers (`indexer_types`, `index_topk_pattern` or `index_topk_freq`) run no indexer
but reuse the selection of the last layer that did.

Tensor-parallel layout: DeepSeek-V3's, the indexers replicated (`layers.dsa`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dgpp.engine.backends.cache_spec import CacheSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.dsa import (
    DsaAttention,
    DsaDims,
    SelectionCarrier,
    check_indexer_layers,
    runs_indexer,
)
from dgpp.engine.layers.mla import MLADims
from dgpp.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from dgpp.engine.models.llama import DecoderLayer


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3 with sparse attention; the indexer's rope in halves."""

    indexer_rope_interleave = False

    def build_layer(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        index: int,
        prefix: str,
    ) -> nn.Module:
        """Layer `index` (or the MTP layer's block): DSA attention and the DeepSeek-V3 MLP."""
        check_indexer_layers(config)
        carrier = self.__dict__.setdefault("_selection", SelectionCarrier())
        dims = DsaDims.of(config, self.indexer_rope_interleave)
        full = runs_indexer(config, index)
        self_attn = DsaAttention(config, parallel, attention, dims, carrier, full)
        mlp = self.build_mlp(config, parallel, index, f"{prefix}.mlp")
        return DecoderLayer(config, self_attn, mlp)

    @property
    def num_slice_layers(self) -> int:
        """No layer slices where a shared-indexer layer reuses the selection an earlier layer
        made in the same forward (GLM-5): a slice starting there would find none."""
        config = self.config
        if not all(runs_indexer(config, index) for index in range(config.num_layers)):
            return 0
        return super().num_slice_layers

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """Each layer's latent cache, then its indexer keys where it runs an indexer."""
        del parallel
        latent = MLADims.of(config).cache_spec
        keys = DsaDims.of(config, cls.indexer_rope_interleave).cache_spec
        specs: list[CacheSpec] = []
        for index in range(config.num_layers):
            specs.append(latent)
            if runs_indexer(config, index):
                specs.append(keys)
        return specs

    @classmethod
    def mtp_cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """The MTP layer's caches: a full layer's (latent and indexer keys)."""
        del parallel
        dims = DsaDims.of(config, cls.indexer_rope_interleave)
        return [MLADims.of(config).cache_spec, dims.cache_spec]


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: interleaved indexer rope, shared-indexer layers."""

    indexer_rope_interleave = True
