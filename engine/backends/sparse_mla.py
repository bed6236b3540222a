"""DeepSeek Sparse Attention (DSA) as an attention backend over any MLA backend: the indexer's
top-k selection batched over the step, and latent attention that gathers only the selected
slots (`kernels.sparse_mla_torch`). A step whose every row fits in the budget (`index_topk`
tokens) needs no selection and runs the dense MLA backend unchanged: below the budget DSA is
dense attention exactly."""

from __future__ import annotations

import torch

from dgpp.engine.backends.base import BatchLayout
from dgpp.engine.backends.mla_base import MLABackend
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.latent_quant import index_key_format, row_format
from dgpp.kernels.mla_attention_torch import store_latent
from dgpp.kernels.sparse_mla_torch import TokenSelection, select_topk, sparse_mla_attention


class SparseMLAAttention:
    """The dense backend's metadata and kernels, plus `select` and a sparse `forward`. Its
    selection reads the rows' lengths on the host, so decode steps are not graph-captured."""

    graph_safe = False

    def __init__(self, dense: MLABackend) -> None:
        self.dense = dense
        self.name = f"sparse-{dense.name}"
        self.kv_dtype: str = getattr(dense, "kv_dtype", "auto")  # latents' and indexer keys'

    def prepare(self, layout: BatchLayout) -> PagedAttentionMetadata:
        return self.dense.prepare(layout)

    def select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        topk: int,
        scale: float,
    ) -> TokenSelection | None:
        """Store the step's indexer keys [T, D] in `cache`, then each query token's top `topk`
        positions by the scores of q [T, Hi, D] weighted by weights [T, Hi]; None when every
        row's context fits in `topk` (attention is dense)."""
        kv = index_key_format(self.kv_dtype, keys.shape[-1])
        store_latent(keys, cache, metadata.slot_mapping, kv)
        if metadata.max_seq_len <= topk:
            return None
        return select_topk(q, weights, cache, metadata, topk, scale, kv)

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        cache: torch.Tensor,
        kv_b: torch.Tensor,
        metadata: PagedAttentionMetadata,
        scale: float,
        selection: TokenSelection | None = None,
    ) -> torch.Tensor:
        """The MLA backend's contract; with a `selection`, each query reads its selected
        latents only."""
        if selection is None:
            return self.dense.forward(q_nope, q_pe, latent, cache, kv_b, metadata, scale)
        kv = row_format(self.kv_dtype, kv_b.shape[-1], q_pe.shape[-1])
        store_latent(latent, cache, metadata.slot_mapping, kv)
        return sparse_mla_attention(q_nope, q_pe, cache, kv_b, selection, scale, kv)
