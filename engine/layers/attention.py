"""Paged attention layer: stores this step's keys and values in the KV pool, then attends."""

from __future__ import annotations

import torch
from torch import nn

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.dispatch import AttentionKernels


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_index: int,
        kernels: AttentionKernels,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_index = layer_index
        self.kernels = kernels

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, H_kv, D], kv_cache [layers, 2, blocks, block, H_kv, D]."""
        key_cache = kv_cache[self.layer_index, 0]
        value_cache = kv_cache[self.layer_index, 1]
        self.kernels.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        return self.kernels.paged_attention(query, key_cache, value_cache, metadata, self.scale)
