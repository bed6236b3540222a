"""Qwen4-Exp's query-sparse attention (QSA): Qwen3.5's gated full attention whose queries
attend only to the tokens a block indexer picks (`backends.sparse_paged`,
`kernels.qsa_torch`).

The indexer projects each token to `indexer_n_heads` query heads and one raw key
(`index_qk_proj`), normalises the queries (zero-centred RMSNorm) and ropes them like the
attention's queries (the first rotary dims); it caches the raw keys (`IndexerKeys`) and scores
mean-pooled, normalised, roped blocks of `indexer_compress_ratio` of them. Each query keeps its
best `indexer_budget / indexer_compress_ratio` blocks and the tail of its incomplete block.

Tensor-parallel layout: the attention's (query and key heads split); the indexer replicated on
every rank, as DSA's is (`layers.dsa`): its selection is one for every head, and its scores
summed over split heads would need an all-reduce per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import StepMetadata
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.attention import PagedAttention
from dgpp.engine.layers.indexer_keys import IndexerKeys
from dgpp.engine.layers.mla import RowSliceLinear
from dgpp.engine.layers.norm import ZeroCentredRMSNorm
from dgpp.engine.layers.rotary import RopeAngles, RotaryEmbedding, rotate_leading
from dgpp.kernels.sparse_mla_torch import TokenSelection


@dataclass(frozen=True)
class QsaDims:
    """The indexer's query heads and head dim, its token budget and block size."""

    num_heads: int
    head_dim: int
    budget: int
    ratio: int

    @classmethod
    def of(cls, config: ModelConfig) -> QsaDims:
        raw = config.raw
        try:
            dims = cls(
                num_heads=int(raw["indexer_n_heads"]),
                head_dim=int(raw["indexer_head_dim"]),
                budget=int(raw["indexer_budget"]),
                ratio=int(raw["indexer_compress_ratio"]),
            )
        except (KeyError, TypeError):
            raise ModelLoadError(
                "config.json lacks the QSA indexer keys (indexer_n_heads, indexer_head_dim, "
                "indexer_budget, indexer_compress_ratio)"
            ) from None
        if int(raw.get("indexer_kv_heads") or 1) != 1 or dims.budget % dims.ratio:
            raise ModelLoadError("QSA needs one indexer key head and a budget of whole blocks")
        if config.rotary_dim > dims.head_dim:
            raise ModelLoadError("the attention's rotary dims do not fit the indexer head")
        return dims


class QsaIndexer(nn.Module):
    """One layer's block indexer, replicated on every rank."""

    def __init__(
        self, config: ModelConfig, dims: QsaDims, backend: Any, rotary: list[RotaryEmbedding]
    ) -> None:
        super().__init__()
        self.dims = dims
        width = (dims.num_heads + 1) * dims.head_dim
        self.index_qk_proj = RowSliceLinear(config.hidden_size, (0, width), bias=False)
        self.q_layernorm = ZeroCentredRMSNorm(dims.head_dim, config.rms_norm_eps)
        self.k_layernorm = ZeroCentredRMSNorm(dims.head_dim, config.rms_norm_eps)
        self.keys = IndexerKeys(dims.head_dim, backend)
        self._rotary = rotary  # the model's tables (not a submodule), for the blocks' positions

    def forward(
        self, hidden: torch.Tensor, angles: RopeAngles, metadata: StepMetadata
    ) -> TokenSelection | None:
        """Store the step's raw keys; each query token's selection (None: all rows dense)."""
        dims, keys = self.dims, self.keys
        assert keys.cache is not None, "the model runner binds every cache before a forward"
        qk = self.index_qk_proj(hidden)
        heads = dims.num_heads * dims.head_dim
        q = qk[:, :heads].view(-1, dims.num_heads, dims.head_dim)
        q = rotate_leading(self.q_layernorm(q), angles)
        backend = keys.backend
        meta = metadata[backend.name]
        return backend.select(
            q, qk[:, heads:], keys.cache, meta, dims.budget, dims.ratio, self._block_keys
        )

    def _block_keys(self, pooled: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Pooled raw keys [B, D] normalised and roped at their blocks' first positions."""
        angles = self._rotary[0].lookup(first, pooled.dtype)
        return rotate_leading(self.k_layernorm(pooled).unsqueeze(1), angles).squeeze(1)


class SparsePagedLayer(PagedAttention):
    """`PagedAttention` over a `SparsePagedAttention` backend, given each step's selection."""

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: StepMetadata,
        angles: RopeAngles | None = None,
        selection: TokenSelection | None = None,
    ) -> torch.Tensor:
        assert self.cache is not None, "the model runner binds every cache before a forward"
        backend: Any = self.backend
        meta = metadata[backend.name]
        if selection is None:
            return super().forward(query, key, value, metadata, angles)
        return backend.forward(query, key, value, self.cache, meta, self.scale, selection=selection)
