"""Paged attention layer: stores this step's keys and values in its cache, then attends."""

from __future__ import annotations

import torch
from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend, StepMetadata
from dgpp.engine.cache_spec import PagedKVSpec


class PagedAttention(nn.Module):
    """A cache layer (`dgpp.engine.cache_spec.CacheLayer`): the model runner binds its share of
    a paged KV pool, [2, blocks, block_size, H_kv, D], before the first forward."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: PagedAttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self._backend = backend
        self.cache: torch.Tensor | None = None

    @property
    def cache_spec(self) -> PagedKVSpec:
        return PagedKVSpec(self.num_kv_heads, self.head_dim)

    @property
    def backend(self) -> PagedAttentionBackend:
        return self._backend

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.cache = cache

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, H_kv, D]; returns [T, H, D]."""
        assert self.cache is not None, "the model runner binds every cache before a forward"
        backend = self._backend
        return backend.forward(query, key, value, self.cache, metadata[backend.name], self.scale)
