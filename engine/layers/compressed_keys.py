"""The paged cache of DeepSeek-V4's compressed keys: one key per window of `rate` tokens, kept in
the KV block holding the window (`rate` divides the block size, so a window never spans two
blocks), `block_size // rate` keys per block.

Paged by the request's block table like any KV, a prefix-cache hit reuses a shared block's keys:
a block is shared only when all its tokens are, so its keys were pooled from the same tokens.
Key w of a request lives in block `table[w * rate // block_size]`, row
`(w * rate % block_size) // rate`. Replicated on every rank (the keys serve every head).

The backend here is the step's `BatchLayout` itself: the layers that read these caches walk the
rows on the host (each row's start, block table and state slot), so their steps are not
graph-captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dgpp.engine.backends.base import BatchLayout
from dgpp.engine.errors import ConfigError
from dgpp.kernels.latent_quant import RowFormat, index_key_format, read_rows, row_format


@dataclass(frozen=True)
class CompressedKeySpec:
    """Keys of `width` for windows of `rate` tokens: per layer [blocks, block_size // rate,
    width]; with a quantized `kv_dtype` uint8 rows (`kernels.latent_quant`), the trailing
    `rope` dims kept in the model dtype, an indexer's keys (`index`) in 8 bits as DSA's."""

    width: int
    rate: int
    rope: int = 0
    index: bool = False
    kv_dtype: str = "auto"
    block_axis = 1  # of the pool `allocate` returns

    @property
    def row_format(self) -> RowFormat | None:
        if self.index:
            return index_key_format(self.kv_dtype, self.width)
        return row_format(self.kv_dtype, self.width - self.rope, self.rope)

    def row_bytes(self, dtype: torch.dtype) -> int:
        fmt = self.row_format
        return self.width * dtype.itemsize if fmt is None else fmt.width(dtype)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return -(-self.row_bytes(dtype) // self.rate)

    def allocate(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        if block_size % self.rate:
            raise ConfigError(
                f"engine.block_size {block_size} is not a multiple of the model's key compression "
                f"rate {self.rate} (a compressed key's window must lie in one block): use "
                f"{self.rate * max(1, -(-block_size // self.rate))} or another multiple"
            )
        fmt = self.row_format
        width = self.width if fmt is None else fmt.width(dtype)
        shape = (num_layers, num_blocks, block_size // self.rate, width)
        return torch.zeros(shape, dtype=dtype if fmt is None else torch.uint8, device=device)


class LayoutBackend:
    """The step's rows as the host knows them; `prepare` hands the layout on unchanged."""

    name = "batch-layout"
    graph_safe = False  # its layers read the rows on the host

    def __init__(self, device: torch.device, kv_dtype: str = "auto") -> None:
        self.device = device
        self.kv_dtype = kv_dtype  # the compressed keys' (`CompressedKeySpec.row_format`)

    def prepare(self, layout: BatchLayout) -> BatchLayout:
        return layout


class CompressedKeys(nn.Module):
    """A cache layer (`cache_spec.CacheLayer`) of one compressor's keys."""

    def __init__(
        self, width: int, rate: int, backend: LayoutBackend, rope: int = 0, index: bool = False
    ) -> None:
        super().__init__()
        self.spec = CompressedKeySpec(width, rate, rope, index, backend.kv_dtype)
        self._backend = backend
        self.cache: torch.Tensor | None = None

    @property
    def cache_spec(self) -> CompressedKeySpec:
        return self.spec

    @property
    def backend(self) -> LayoutBackend:
        return self._backend

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.cache = cache

    def _places(
        self, table: Sequence[int], first: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks and rows of keys first .. first + count - 1."""
        assert self.cache is not None, "the model runner binds every cache before a forward"
        rate, per_block, device = self.spec.rate, self.cache.shape[1], self.cache.device
        starts = torch.arange(first, first + count, device=device) * rate  # windows' tokens
        blocks = torch.as_tensor(table, dtype=torch.int64, device=device)
        return blocks[starts // (rate * per_block)], (starts // rate) % per_block

    def store(self, keys: torch.Tensor, table: Sequence[int], first: int) -> None:
        """Keep keys [n, width] as windows first .. first + n - 1 of the request."""
        if keys.shape[0]:
            assert self.cache is not None
            blocks, rows = self._places(table, first, keys.shape[0])
            fmt = self.spec.row_format
            self.cache[blocks, rows] = (
                keys.to(self.cache.dtype) if fmt is None else fmt.encode(keys)
            )

    def read(self, table: Sequence[int], count: int, dtype: torch.dtype) -> torch.Tensor:
        """The request's first `count` keys [count, width] in `dtype` (the model's)."""
        assert self.cache is not None
        blocks, rows = self._places(table, 0, count)
        return read_rows(self.cache[blocks, rows], self.spec.row_format, dtype)
