"""Tensor-parallel context: which shard this rank holds and the collectives that join shards.

A single device is the degenerate case (`tp_size == 1`): every collective is the identity, so model
code never branches on the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    # torch.distributed ProcessGroup; None means the default group, whichever is current, so a
    # rank keeps its model (which holds this context) when the world is re-formed around it.
    group: Any = None

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, "tp_rank out of range"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the tensor-parallel group, in place."""
        if self.tp_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along its last dimension, in rank order."""
        if self.tp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, size: int, what: str) -> int:
        """Size of this rank's shard of a dimension of `size`; the dimension must divide evenly."""
        if size % self.tp_size:
            raise ValueError(f"{what}={size} is not divisible by tp_size={self.tp_size}")
        return size // self.tp_size
