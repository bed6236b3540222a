"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, GLM-5): multi-head latent attention
(`layers.mla`) whose queries attend only to the `index_topk` context tokens a lightning indexer
picks (`backends.sparse_mla`).

The indexer: queries `wq_b` from MLA's normed query latent, one key per token `k_norm(wk(x))`
(a LayerNorm), rope on the first `qk_rope_head_dim` dims of both (rotate-half for DeepSeek-V3.2,
interleaved for GLM-5), and per-head weights `weights_proj(x) / sqrt(heads)`. Its keys are a
cache of their own (`IndexerKeys`, `cache_spec.IndexerKeySpec`), paged with the latents.
GLM-5's "shared" layers run no indexer and reuse the selection of the last layer that did
(`SelectionCarrier`).

Tensor-parallel layout: MLA's (heads split, latent replicated); the indexer replicated on
every rank. Its selection must be one for all heads, and splitting its heads would all-reduce
a [tokens, context] score matrix per layer (64K context: 256 KiB per query token), far more
than the replicated projections' work (a few MiB of weights per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.backends.cache_spec import IndexerKeySpec
from dgpp.engine.backends.sparse_mla import SparseMLAAttention
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.indexer_keys import IndexerKeys
from dgpp.engine.layers.mla import LatentAttention, MultiHeadLatentAttention, RowSliceLinear
from dgpp.engine.layers.rotary import RopeAngles, rotate_leading
from dgpp.kernels.sparse_mla_torch import TokenSelection

INDEXER_NORM_EPS = 1e-6  # transformers' `k_norm` LayerNorm


@dataclass(frozen=True)
class DsaDims:
    """The indexer's shapes: the budget `topk`, its heads and head dim, and whether its rope
    dims come in pairs (GLM-5) or halves (DeepSeek-V3.2)."""

    topk: int
    num_heads: int
    head_dim: int
    rope_interleave: bool

    @property
    def cache_spec(self) -> IndexerKeySpec:
        return IndexerKeySpec(self.head_dim)

    @classmethod
    def of(cls, config: ModelConfig, rope_interleave: bool) -> DsaDims:
        raw = config.raw
        try:
            return cls(
                topk=int(raw["index_topk"]),
                num_heads=int(raw["index_n_heads"]),
                head_dim=int(raw["index_head_dim"]),
                rope_interleave=rope_interleave,
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks the sparse-attention key {missing}") from None


def runs_indexer(config: ModelConfig, index: int) -> bool:
    """Whether layer `index` runs its own indexer ("full") or reuses the last full layer's
    selection ("shared", GLM-5): `indexer_types`, else `index_topk_pattern` ("F"/"S"), else
    every `index_topk_freq`-th layer from `index_skip_topk_offset`, as transformers reads
    them. Layers past the list (the MTP layer) run their own."""
    raw = config.raw
    kinds = raw.get("indexer_types") or raw.get("index_topk_pattern")
    if kinds is not None:
        if index >= len(kinds):
            return True
        return kinds[index] in ("full", "F")
    freq = max(int(raw.get("index_topk_freq") or 1), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return max(index - offset + 1, 0) % freq == 0


def check_indexer_layers(config: ModelConfig) -> None:
    """The first layer must run an indexer: a shared layer reuses an earlier selection."""
    if config.raw.get("q_lora_rank") is None:
        raise ModelLoadError("sparse attention needs q_lora_rank: its indexer reads the q latent")
    if config.num_layers and not runs_indexer(config, 0):
        raise ModelLoadError("layer 0 is a shared-indexer layer, but no layer before it selects")


class SelectionCarrier:
    """The selection the last full-indexer layer made in this forward, for the shared layers
    after it (GLM-5). Every forward starts at layer 0, which is full, so it is never stale."""

    def __init__(self) -> None:
        self.value: TokenSelection | None = None


class Indexer(nn.Module):
    """The lightning indexer of one layer, replicated on every rank (see the module doc)."""

    def __init__(
        self, config: ModelConfig, q_lora_rank: int, dims: DsaDims, backend: SparseMLAAttention
    ) -> None:
        super().__init__()
        self.dims = dims
        width = dims.num_heads * dims.head_dim
        self.wq_b = RowSliceLinear(q_lora_rank, (0, width), bias=False)
        self.wk = RowSliceLinear(config.hidden_size, (0, dims.head_dim), bias=False)
        self.k_norm = nn.LayerNorm(dims.head_dim, eps=INDEXER_NORM_EPS).requires_grad_(False)
        self.weights_proj = RowSliceLinear(config.hidden_size, (0, dims.num_heads), bias=False)
        self.keys = IndexerKeys(dims.head_dim, backend)

    def forward(
        self,
        q_resid: torch.Tensor,
        hidden: torch.Tensor,
        angles: RopeAngles,
        metadata: StepMetadata,
    ) -> TokenSelection | None:
        """Store the step's keys; each query token's selection (None: all rows dense)."""
        dims, keys = self.dims, self.keys
        assert keys.cache is not None, "the model runner binds every cache before a forward"
        q = self.wq_b(q_resid).view(-1, dims.num_heads, dims.head_dim)
        q = rotate_leading(q, angles, dims.rope_interleave)
        k = self.k_norm(self.wk(hidden)).unsqueeze(1)
        k = rotate_leading(k, angles, dims.rope_interleave).squeeze(1)
        weights = self.weights_proj(hidden).float() * dims.num_heads**-0.5
        backend = keys.backend
        meta = metadata[backend.name]
        return backend.select(q, weights, k, keys.cache, meta, dims.topk, dims.head_dim**-0.5)


class SparseLatentAttention(LatentAttention):
    """`LatentAttention` over a `SparseMLAAttention` backend, given each step's selection."""

    def forward(  # type: ignore[override]
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        kv_b: torch.Tensor,
        metadata: StepMetadata,
        selection: TokenSelection | None = None,
    ) -> torch.Tensor:
        assert self.cache is not None, "the model runner binds every cache before a forward"
        backend: Any = self.backend  # a SparseMLAAttention (any backend when only counted)
        meta = metadata[backend.name]
        return backend.forward(q_nope, q_pe, latent, self.cache, kv_b, meta, self.scale, selection)


class DsaAttention(MultiHeadLatentAttention):
    """MLA plus an indexer (`full`) or the carried selection of the last layer with one."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: Any,
        dims: DsaDims,
        carrier: SelectionCarrier,
        full: bool,
    ) -> None:
        super().__init__(config, parallel, backend)
        self.attn = SparseLatentAttention(self.dims, self.attn.scale, backend)
        self._carrier = carrier
        q_lora_rank = self.dims.q_lora_rank
        assert q_lora_rank is not None, "check_indexer_layers refuses DSA without a query rank"
        self.indexer = Indexer(config, q_lora_rank, dims, backend) if full else None

    def forward(
        self,
        angles: RopeAngles,
        hidden: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        q_nope, q_pe, latent, q_resid = self.project(angles, hidden)
        if self.indexer is not None:
            assert q_resid is not None
            self._carrier.value = self.indexer(q_resid, hidden, angles, metadata)
        kv_b = self.kv_b_proj.per_head()
        out = self.attn(q_nope, q_pe, latent, kv_b, metadata, self._carrier.value)
        return self.output(out)
