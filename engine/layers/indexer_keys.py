"""The key cache of a sparse-attention indexer (DeepSeek-V3.2 and GLM-5's lightning indexer,
Qwen4-Exp's block indexer): one key per token, paged by the same block ids as the layer's
attention cache, so a prefix-cache hit reuses both."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.cache_spec import IndexerKeySpec


class IndexerKeys(nn.Module):
    """A cache layer (`cache_spec.CacheLayer`): [blocks, block_size, head_dim]; `backend` is
    the sparse backend whose metadata and `select` the indexer uses."""

    def __init__(self, head_dim: int, backend: Any) -> None:
        super().__init__()
        self.spec = IndexerKeySpec(head_dim)
        self._backend = backend
        self.cache: torch.Tensor | None = None

    @property
    def cache_spec(self) -> IndexerKeySpec:
        return replace(self.spec, kv_dtype=getattr(self._backend, "kv_dtype", "auto"))

    @property
    def backend(self) -> Any:
        return self._backend

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.cache = cache
