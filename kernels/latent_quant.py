"""Quantized rows of a token-row cache (`engine.kv_cache_dtype` for multi-head latent attention's
latents and a sparse indexer's keys): one row per token, uint8 [..., width], that the prefix
cache's tiers copy as they are and a reader dequantizes only where it gathers.

A row is its first `quantized` elements in `kernels.kv_quant`'s blocks (int8: Q8_0, fp8_e4m3:
one scale, int4: Q4_0), padded to 16 bytes, then its last `kept` elements in the model dtype's
own bytes. MLA keeps its rotated rope key (`qk_rope_head_dim`, 64 of DeepSeek's 576) there, as
FlashMLA's FP8 cache does: the latent is normalised and takes 8 bits well, the rope key carries
position through its larger entries (docs/quality.md measures both choices). DeepSeek-V3's 576
values are 544 + 128 bytes at int8 (1.71x a bfloat16 cache's tokens per byte), 528 + 128 at fp8
(1.76x).

`row_format(kv_dtype, L + R)`, nothing kept, quantizes the rope key too: the measured
alternative.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from dgpp.kernels.kv_quant import KvFormat, kv_format

ALIGN = 16  # bytes: the kept part starts, and a row ends, on this boundary


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


@dataclass(frozen=True)
class RowFormat:
    codes: KvFormat  # the quantized leading part's blocks
    kept: int  # trailing elements stored in the model dtype

    @property
    def quantized(self) -> int:
        return self.codes.head_dim

    @property
    def codes_bytes(self) -> int:
        """Where the kept part starts, in bytes (the codes padded to `ALIGN`)."""
        return _aligned(self.codes.width)

    def width(self, dtype: torch.dtype) -> int:
        """Bytes of one row for a model of `dtype`."""
        return _aligned(self.codes_bytes + self.kept * dtype.itemsize)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, quantized + kept] in the model dtype -> uint8 [T, width(dtype)]."""
        count = rows.shape[0]
        out = rows.new_zeros(count, self.width(rows.dtype), dtype=torch.uint8)
        out[:, : self.codes.width] = self.codes.encode(rows[:, : self.quantized])
        kept = rows[:, self.quantized :].contiguous().view(torch.uint8)
        out[:, self.codes_bytes : self.codes_bytes + kept.shape[1]] = kept
        return out

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [..., width(dtype)] -> [..., quantized + kept] in `dtype`."""
        lead = rows.shape[:-1]
        flat = rows.reshape(-1, rows.shape[-1])
        values = self.codes.decode(flat[:, : self.codes.width], dtype)
        start = self.codes_bytes
        kept = flat[:, start : start + self.kept * dtype.itemsize].contiguous().view(dtype)
        return torch.cat((values, kept), dim=-1).reshape(*lead, self.quantized + self.kept)


@cache
def row_format(kv_dtype: str, quantized: int, kept: int = 0) -> RowFormat | None:
    """The row format of `kv_dtype` (None for `auto`) for rows of `quantized` leading elements
    in blocks and `kept` trailing ones in the model dtype."""
    codes = kv_format(kv_dtype, quantized)
    return None if codes is None else RowFormat(codes, kept)


def index_key_format(kv_dtype: str, width: int) -> RowFormat | None:
    """A sparse indexer's keys at `kv_dtype`: 8 bits (DeepSeek-V3.2's own indexer cache is
    FP8), int8 and fp8_e4m3 as they are, int4 KV keeps int8 keys (a 4-bit score would move the
    budget's cut)."""
    return row_format("int8" if kv_dtype == "int4" else kv_dtype, width)


def store_rows(
    rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, fmt: RowFormat | None
) -> None:
    """Write rows [T, C] into cache [blocks, block_size, width] at `slot_mapping` [T], encoded
    when the cache is quantized (`fmt`)."""
    if fmt is not None:
        rows = fmt.encode(rows)
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows)


def read_rows(
    rows: torch.Tensor, fmt: RowFormat | KvFormat | None, dtype: torch.dtype
) -> torch.Tensor:
    """Gathered cache rows [..., width] as values [..., C] in `dtype` (as they are at `auto`)."""
    return rows if fmt is None else fmt.decode(rows, dtype)
