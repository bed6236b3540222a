"""Split-K decode (flash-decoding) for the per-token paged-attention kernel.

A decode step of a few rows has few (token, KV head) programs, one per pair, each walking its
whole context: at 100K+ tokens most of the GPU idles. `decode_split` then cuts every context
into partitions of whole pages; each program reads one partition and stores its running
maximum, denominator and unnormalised weighted sum, and `combine_partitions` merges them (the
sink's logit, when the model has one, joins the denominator here, once). The partition count
follows `max_seq_len`, a host value of the step (a graph captures the model length's), so it
is fixed for a step; programs past a row's own length store an empty partition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PARTITION_KEYS = 512  # the shortest partition
MAX_PARTS = 32  # longer contexts get longer partitions
SPLIT_BELOW = 256  # split when a step has fewer (token, KV head) programs than this


def decode_split(
    decoded: int, num_kv_heads: int, max_seq_len: int, block_size: int, partition_keys: int
) -> tuple[int, int] | None:
    """(pages per partition, partitions) for a decode step, or None to run unsplit."""
    if decoded * num_kv_heads >= SPLIT_BELOW or max_seq_len <= partition_keys:
        return None
    pages = -(-max_seq_len // block_size)
    per_part = max(-(-partition_keys // block_size), -(-pages // MAX_PARTS))
    parts = -(-pages // per_part)
    return (per_part, parts) if parts > 1 else None


@triton.jit
def _combine_kernel(
    part_ptr: tl.tensor,
    stat_ptr: tl.tensor,
    sinks_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_parts: int,
    stat_plane: int,
    stride_ot: int,
    stride_oh: int,
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
) -> None:
    token = tl.program_id(0)
    head = tl.program_id(1)
    base = (token * tl.num_programs(1) + head) * num_parts
    c = tl.arange(0, CHUNK)
    top = tl.full([CHUNK], float("-inf"), tl.float32)
    for start in range(0, num_parts, CHUNK):
        m = tl.load(stat_ptr + base + start + c, mask=start + c < num_parts, other=float("-inf"))
        top = tl.maximum(top, m)
    best = tl.max(top)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        best = tl.maximum(best, sink)
        total = tl.exp(sink - best)
    else:
        total = tl.sum(tl.zeros([CHUNK], tl.float32))  # a float32 scalar, as in the loop
    d = tl.arange(0, DIM_P2)
    d_ok = d < HEAD_DIM
    acc = tl.zeros([DIM_P2], tl.float32)
    for start in range(0, num_parts, CHUNK):
        ok = start + c < num_parts
        m = tl.load(stat_ptr + base + start + c, mask=ok, other=float("-inf"))
        l_part = tl.load(stat_ptr + stat_plane + base + start + c, mask=ok, other=0.0)
        weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - best))  # empty partitions: 0
        total += tl.sum(l_part * weight)
        part = tl.load(
            part_ptr + (base + start + c)[:, None] * HEAD_DIM + d[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc += tl.sum(part * weight[:, None], axis=0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        (acc / total).to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def combine_partitions(
    part: torch.Tensor, stat: torch.Tensor, sinks: torch.Tensor | None, out: torch.Tensor
) -> None:
    """Merge the partitions `part` [T, H, P, D] with their maxima and denominators `stat`
    [2, T, H, P] (float32) into `out` [T, H, D]."""
    tokens, heads, parts, head_dim = part.shape
    _combine_kernel[(tokens, heads)](
        part, stat, sinks if sinks is not None else part, out, parts, tokens * heads * parts,
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_P2=triton.next_power_of_2(head_dim), CHUNK=16,
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
