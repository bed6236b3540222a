"""Qwen4-Exp's query-sparse attention (QSA) as an attention backend over any paged-attention
backend: the indexer's block selection batched over the step (`kernels.qsa_torch`), and
attention that gathers only the selected tokens' keys and values from the paged cache. A step
whose every row keeps all its blocks needs no selection and runs the dense backend unchanged:
below the budget QSA is dense attention exactly."""

from __future__ import annotations

import torch

from dgpp.engine.backends.base import BatchLayout, PagedAttentionBackend
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.kv_quant import kv_format
from dgpp.kernels.latent_quant import index_key_format
from dgpp.kernels.mla_attention_torch import store_latent
from dgpp.kernels.paged_attention_torch import store_kv
from dgpp.kernels.qsa_torch import BlockKeys, needs_selection, select_blocks, sparse_paged_attention
from dgpp.kernels.sparse_mla_torch import TokenSelection


class SparsePagedAttention:
    """The dense backend's metadata and kernels, plus `select` and a sparse `forward`. Its
    selection reads the rows' lengths on the host, so decode steps are not graph-captured."""

    graph_safe = False
    fuses_rope = False

    def __init__(self, dense: PagedAttentionBackend) -> None:
        self.dense = dense
        self.name = f"sparse-{dense.name}"
        self.device = getattr(dense, "device", torch.device("cpu"))
        self.kv_dtype: str = getattr(dense, "kv_dtype", "auto")  # keys, values, indexer keys

    def prepare(self, layout: BatchLayout) -> PagedAttentionMetadata:
        return self.dense.prepare(layout)

    def select(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        budget: int,
        ratio: int,
        block_keys: BlockKeys,
    ) -> TokenSelection | None:
        """Store the step's raw indexer keys [T, D] in `cache`, then each query token's
        selection by the scores of q [T, Hi, D]; None when every row keeps all its blocks."""
        kv = index_key_format(self.kv_dtype, keys.shape[-1])
        store_latent(keys, cache, metadata.slot_mapping, kv)
        if not needs_selection(metadata.max_seq_len, budget, ratio):
            return None
        return select_blocks(q, cache, metadata, budget, ratio, block_keys, kv)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        scale: float,
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
        angles: tuple[torch.Tensor, torch.Tensor] | None = None,
        selection: TokenSelection | None = None,
    ) -> torch.Tensor:
        """The paged backend's contract; with a `selection`, each query reads its selected
        tokens only (no sinks or sliding windows: no QSA model has them)."""
        if selection is None:
            return self.dense.forward(
                query, key, value, cache, metadata, scale, sinks, sliding_window, angles
            )
        assert sinks is None and sliding_window is None and angles is None
        kv = kv_format(self.kv_dtype, query.shape[-1])
        store_kv(key, value, cache[0], cache[1], metadata.slot_mapping, kv)
        return sparse_paged_attention(query, cache[0], cache[1], selection, scale, kv)
