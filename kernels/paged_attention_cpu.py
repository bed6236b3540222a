"""Paged attention on CPUs: a small compiled kernel that reads the paged KV cache in place
(kernels/cpu/paged_attention.cpp) for a whole step (decode rows, verify rows, prefill chunks) in
one call per layer, the PyTorch twin for what it does not take.

`paged_attention_cpu` has the twin's signature (`paged_attention_torch.paged_attention`) and its
result up to float32 summation order. The twin gathers each row's context into a contiguous
copy and runs PyTorch's SDPA with a mask: at 6,000 cached positions that is about 1 ms of copies
and 1 ms of fixed SDPA cost a layer for a 16-token chunk, more than the chunk's own work, and a
decode step pays a padded gather of every row's context. The kernel takes steps whose queries
and caches are float32, without attention sinks or a sliding window shorter than a row, and
head shapes it tiles (at most 24 query heads per KV head, head dims a multiple of 8, blocks of
at most 64 tokens); the rest goes to the twin. Where the kernel cannot be built, the twin
serves, said once.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.cpu_build import load_cpu_extension
from dgpp.kernels.kv_quant import KvFormat
from dgpp.kernels.paged_attention_torch import paged_attention

SOURCE = Path(__file__).with_name("cpu") / "paged_attention.cpp"
MAX_BLOCK_SIZE = 64  # the kernel's limits (kernels/cpu/paged_attention.cpp)
MAX_GROUP = 24  # query heads per KV head (its tiles hold 24 or 48 rows)
HEAD_DIM_MULTIPLE = 8

log = logging.getLogger(__name__)


@cache
def cpu_extension() -> ModuleType | None:
    """The compiled kernel, built on first use; None (logged once) when it cannot be."""
    return load_cpu_extension(
        SOURCE, "attn", "paged attention CPU kernel", log, "prefill attention uses the PyTorch twin"
    )


def kernel_applies(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    sinks: torch.Tensor | None,
) -> bool:
    """Whether the compiled kernel can take this layer's prefill rows."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    return (
        sinks is None
        and query.device.type == "cpu"
        and query.dtype == torch.float32
        and key_cache.dtype in (torch.float32, torch.uint8)  # uint8: int8 rows (the caller's)
        and block_size <= MAX_BLOCK_SIZE
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim % HEAD_DIM_MULTIPLE == 0
        and cpu_extension() is not None
    )


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    kv: KvFormat | None = None,
) -> torch.Tensor:
    """The twin's attention; the whole step in one call of the compiled kernel where it applies
    (no sinks, no window that excludes a key of any row, float32, `out` contiguous, a float32
    cache, int8 rows of 32-value blocks or fp8 rows: int4 rows go to the twin)."""
    excludes = sliding_window is not None and metadata.max_seq_len > sliding_window
    if cpu_kv_kind(kv) is None:  # the kernel reads float32, int8 and fp8 rows
        return paged_attention(
            query, key_cache, value_cache, metadata, scale, sinks, sliding_window, out, kv
        )
    if (
        excludes
        or not kernel_applies(query, key_cache, sinks)
        or (out is not None and not out.is_contiguous())
    ):
        return paged_attention(
            query, key_cache, value_cache, metadata, scale, sinks, sliding_window, out, kv
        )
    ext = cpu_extension()
    assert ext is not None
    out = torch.empty_like(query) if out is None else out
    ext.paged_attention(
        query.contiguous(),
        key_cache,
        value_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale,
        out,
        cpu_kv_kind(kv),
    )
    return out


def cpu_kv_kind(kv: KvFormat | None) -> int | None:
    """The compiled kernels' `KvKind` of a cache (kernels/cpu/decode_attention.h): 0 float32,
    1 int8 rows of 32-value Q8_0 blocks, 2 fp8_e4m3 rows; None for rows they do not read."""
    if kv is None:
        return 0
    if kv.name == "int8" and kv.group == 32:
        return 1
    return 2 if kv.name == "fp8_e4m3" else None
