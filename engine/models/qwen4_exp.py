"""Qwen4-Exp (`qwen4_exp`, the Qwen Flash-Next line): Qwen3.5-MoE's hybrid decoder (Gated
DeltaNet linear layers, gated attention every few layers, softmax-routed experts with a gated
shared expert) with three changes:

- the attention layers are query-sparse (`layers.qsa`): a block indexer picks the tokens each
  query attends to, its raw keys a cache of their own;
- the residual is `hc_count` hyper-connection streams (`layers.hyper_connections`) in place of
  pre-norms and a final norm;
- the linear layers listed in `ple_layer_ids` (one-based) add per-layer embeddings of hashed
  n-grams (`layers.ple`), whose tables stay on disk (`layers.ngram_table`, attached after the
  weights load; `ngram_tables_in_memory` reads them into RAM instead).

`Qwen4ExpForConditionalGeneration` is served text-only, as Qwen3.5's vision-language
checkpoints are. Speculative decoding: n-gram drafts (verify rows keep the recurrent and PLE
states per position); the MTP layers are not built.

Tensor-parallel layout: Qwen3.5's for attention, linear layers and experts; the indexers,
hyper-connections and PLE layers replicated, their n-gram tables mapped on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend, StepMetadata
from dgpp.engine.backends.cache_spec import CacheSpec, IndexerKeySpec, PagedKVSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.gated_deltanet import GatedDeltaNet, linear_state_spec
from dgpp.engine.layers.head_partition import partition_heads
from dgpp.engine.layers.hyper_connections import HyperConnection, HyperDecoderLayer
from dgpp.engine.layers.ngram_table import open_tables
from dgpp.engine.layers.ple import PerLayerEmbedding, PleDims
from dgpp.engine.layers.qsa import QsaDims, QsaIndexer, SparsePagedLayer
from dgpp.engine.layers.rotary import RopeAngles, RotaryEmbedding
from dgpp.engine.models.llama import DecoderModel
from dgpp.engine.models.qwen3_5 import Qwen3_5MoeForCausalLM, qwen3_5_checkpoint_name
from dgpp.engine.models.qwen3_next import GatedAttention, layer_types, qwen3_next_mlp

_TABLES = ".ple.ple_embedding."  # the n-gram tables and their hashing constants


def qwen4_checkpoint_name(name: str) -> str | None:
    """Qwen3.5's names; the PLE tables (mapped apart), hashing constants and vision tower
    (served text-only: its decoder's streams take no image tokens yet) skipped."""
    if _TABLES in name or name.startswith("model.visual."):
        return None
    return qwen3_5_checkpoint_name(name)


def ple_layers(config: ModelConfig) -> list[int]:
    """The zero-based layers with PLE."""
    return [index - 1 for index in sorted(set(config.raw.get("ple_layer_ids") or ()))]


class QsaGatedAttention(GatedAttention):
    """Gated full attention (QK norm, partial rotary, sigmoid output gate) over the tokens its
    indexer selects."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        prefix: str,
        rotary: list[RotaryEmbedding],
    ) -> None:
        super().__init__(config, parallel, attention, prefix)
        dense = self.attn
        self.attn = SparsePagedLayer(
            dense.num_heads,
            dense.num_kv_heads,
            dense.head_dim,
            dense.scale,
            attention,
            first_head=dense.first_head,
        )
        self.indexer = QsaIndexer(config, QsaDims.of(config), attention, rotary)

    def forward(
        self, angles: RopeAngles, hidden: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        selection = self.indexer(hidden, angles, metadata)
        return self.gated(angles, hidden, metadata, selection)


class HyperDecoderModel(DecoderModel):
    """The embedding copied into every stream, the layers, and a last mix of the streams in
    place of the final norm."""

    plain_residual = False

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        rotary_dim: int,
        layers: list[nn.Module],
    ) -> None:
        super().__init__(config, parallel, max_position, rotary_dim, layers)
        del self.norm
        self.streams = int(config.raw.get("hc_count", 4))
        self.hyper_connection_mixer = HyperConnection(config, combine=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        angles = self.rotary.lookup(positions, hidden.dtype)
        streams = hidden.repeat(1, self.streams)
        for layer in self.layers:
            streams = layer(angles, streams, metadata, input_ids)
        return self.hyper_connection_mixer.mix(streams)[0]


class Qwen4ExpForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen4-Exp; also serves `Qwen4ExpForConditionalGeneration` text-only."""

    checkpoint_name = staticmethod(qwen4_checkpoint_name)
    serves_images = False
    build_mlp = staticmethod(qwen3_next_mlp)
    decoder_model = HyperDecoderModel
    mtp_supported = False

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        self._rotary: list[RotaryEmbedding] = []
        super().__init__(config, parallel, max_position, attention)
        del self.model.norm  # Qwen3-Next's zero-centred final norm: Qwen4-Exp mixes instead
        self._rotary.append(self.model.rotary)

    def build_layer(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        index: int,
        prefix: str,
    ) -> nn.Module:
        mlp = self.build_mlp(config, parallel, index, f"{prefix}.mlp")
        ple = None
        if index in ple_layers(config):
            table = f"{prefix}{_TABLES}ngram_embedding"
            ple_index = ple_layers(config).index(index)
            ple = PerLayerEmbedding(config, ple_index, self._state_backend, table)
        if layer_types(config)[index] == "linear_attention":
            backend = self._state_backend
            mixer = GatedDeltaNet(config, parallel, backend, f"{prefix}.linear_attn", split=True)
            return HyperDecoderLayer(config, mixer, "linear_attn", mlp, ple)
        attn = QsaGatedAttention(config, parallel, attention, f"{prefix}.self_attn", self._rotary)
        return HyperDecoderLayer(config, attn, "self_attn", mlp, ple)

    def attach_tables(self, checkpoint: Path, in_memory: bool) -> None:
        """Map (or read) every PLE layer's n-gram table from the checkpoint."""
        layers = [m for m in self.modules() if isinstance(m, PerLayerEmbedding)]
        if not layers:
            return
        found = {}
        for name, table in open_tables(checkpoint, in_memory).items():
            renamed = qwen3_5_checkpoint_name(f"{name}.weight")
            if renamed is not None:
                found[renamed.removesuffix(".weight")] = table
        for layer in layers:
            table = found.get(layer.table_name)
            heads = layer.hashing.num_heads
            width = layer.dims.embed_dim // heads
            if table is None:
                raise ModelLoadError(f"the checkpoint has no n-gram table {layer.table_name}")
            if table.num_rows < layer.hashing.num_rows or table.dim * heads != layer.dims.embed_dim:
                raise ModelLoadError(
                    f"n-gram table {layer.table_name} of {table.num_rows} rows x {table.dim}; "
                    f"the config asks {layer.hashing.num_rows} rows x {width}"
                )
            layer.table = table

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """Each attention layer's KV, then its indexer's keys."""
        heads = partition_heads(
            config.num_heads, config.num_kv_heads, parallel.tp_size, parallel.tp_rank
        )
        kv = PagedKVSpec(heads.num_kv, config.head_dim)
        keys = IndexerKeySpec(QsaDims.of(config).head_dim)
        attention = sum(kind != "linear_attention" for kind in layer_types(config))
        return [kv, keys] * attention

    @classmethod
    def state_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[Any]:
        """Per layer, its PLE state (if any), then its Gated DeltaNet state (if linear)."""
        specs: list[Any] = []
        ple = ple_layers(config)
        for index, kind in enumerate(layer_types(config)):
            if index in ple:
                specs.append(PleDims.of(config).state_spec())
            if kind == "linear_attention":
                specs.append(linear_state_spec(config, parallel))
        return specs
