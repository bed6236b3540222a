"""Routing assignments grouped by expert in blocks, on the device: the input of the fused MoE
kernel (`fused_moe_triton`).

Assignment a = t * k + j is token t's j-th expert. `align_by_expert` lays the assignments out
grouped by expert (stable: token order within an expert), each expert's run padded to whole
blocks of `block_m`, so every block of rows belongs to one expert. Its length is a bound known
from the shapes alone, n + min(n, E) * (block_m - 1) rounded up to a block, so no value is read
on the host and a step's shapes do not depend on its routing (CUDA graphs).
"""

from __future__ import annotations

import torch


def aligned_capacity(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Rows the aligned layout has: every non-empty expert wastes less than one block."""
    rows = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` [T, k] -> (the assignments in blocks [capacity] int64, padded with T * k; each
    block's expert [capacity // block_m] int64, -1 for the blocks past the last expert's)."""
    flat = ids.reshape(-1)
    num = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no bincount: its size reads the max
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    run_start = torch.cumsum(counts, 0) - counts  # each expert's first place in `order`
    rank = torch.arange(num, device=device) - run_start[expert_of]
    capacity = aligned_capacity(num, num_experts, block_m)
    rows = torch.full((capacity,), num, dtype=torch.int64, device=device)
    rows.scatter_(0, (ends - padded)[expert_of] + rank, order)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    return rows, torch.where(block_expert < num_experts, block_expert, -1)
