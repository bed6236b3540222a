"""The Triton paged-attention backend (CUDA): the PyTorch backend's metadata and cache layout,
attention by `kernels.paged_attention_triton`, which reads every row of the step straight from
the paged cache through its block table."""

from __future__ import annotations

import torch

from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.paged_attention_torch import store_kv
from dgpp.kernels.paged_attention_triton import paged_attention_triton


class TritonPagedAttention(TorchPagedAttention):
    name = "triton-paged"

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
    ) -> torch.Tensor:
        key_cache, value_cache = cache[0], cache[1]
        store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        return paged_attention_triton(
            query, key_cache, value_cache, metadata, scale, sinks, sliding_window
        )
