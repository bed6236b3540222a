"""Joins this process to a tensor-parallel world over torch.distributed."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from dgpp.engine.parallel import ParallelContext


@dataclass(frozen=True)
class WorldSpec:
    """Where and how ranks meet: rank 0's address and rendezvous port, and the deadlines."""

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29517
    backend: str = "gloo"  # "nccl" on CUDA
    rendezvous_timeout_s: float = 120.0


def join_world(spec: WorldSpec) -> ParallelContext:
    """Form (or join) the world; returns this rank's tensor-parallel context."""
    dist.init_process_group(
        backend=spec.backend,
        init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.rendezvous_timeout_s),
    )
    return ParallelContext(tp_rank=spec.rank, tp_size=spec.world_size, group=dist.group.WORLD)


def leave_world() -> None:
    """Orderly exit: wait until every rank is leaving, then tear down. Callers drop everything
    that holds the process group first (the model's layers do): a group object that outlives
    `destroy_process_group` is destroyed during interpreter teardown with its threads still
    joinable, which aborts the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
