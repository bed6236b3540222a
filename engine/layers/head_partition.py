"""Which attention heads each tensor-parallel rank holds.

Heads are dealt out by key/value group, so a rank always holds whole groups (or, with fewer
key/value heads than ranks, one replicated key/value head and a share of its query heads). Counts
need not divide evenly: SmolLM2-135M has 9 query and 3 key/value heads, and on two ranks one
holds two groups (6 query heads) and the other one group (3); the row-parallel output projection
takes the matching slices of its input, and the all-reduce sums them whatever their sizes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadPartition:
    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def _share(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part `index` when `total` items are dealt into `parts` near-equal runs."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


def partition_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadPartition:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of {num_kv_heads=}")
    if tp_size > num_heads:
        raise ValueError(f"tp_size={tp_size} exceeds num_attention_heads={num_heads}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, num_kv = _share(num_kv_heads, tp_size, tp_rank)
        return HeadPartition(kv_start * group, num_kv * group, kv_start, num_kv)
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size={tp_size} is not a multiple of num_kv_heads={num_kv_heads}")
    ranks_per_kv = tp_size // num_kv_heads
    kv_head, sub_rank = divmod(tp_rank, ranks_per_kv)
    if group < ranks_per_kv:
        raise ValueError(f"tp_size={tp_size} leaves some rank without a query head")
    q_offset, num_q = _share(group, ranks_per_kv, sub_rank)
    return HeadPartition(kv_head * group + q_offset, num_q, kv_head, 1)
