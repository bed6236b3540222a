"""The prefix cache's host tier on one rank: a copy of each cache pool in host memory, with
`num_slots` blocks, and the copies between the pools and it that step messages carry
(`dgpp.engine.cache.host_tier` records them on rank 0; every rank runs them in order before the
step's forward). On a CUDA device the host copies are pinned, so the copies go by DMA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dgpp.engine.cache.host_tier import LOAD, SPILL, STATES, Copy
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.planning.memory_plan import GIB, kv_bytes_per_token, rank_cache_specs
from dgpp.engine.planning.weight_count import uses_mtp

if TYPE_CHECKING:
    from dgpp.engine.cache.disk_store import DiskStore

MIN_SLOTS = 2  # a spill never reuses the slot a load in the same allocation reads (host_tier)


STATE_SHARE = 0.5  # of a hybrid model's host tier, what its snapshots get (blocks the rest)


def host_slots(
    config: EngineConfig, model: ModelConfig, tp_size: int, state_slot_bytes: int = 0
) -> tuple[int, int]:
    """Blocks and snapshots the host tier holds: `prefix_cache_host_gib` over rank 0's bytes
    per block (it holds the most; every rank keeps as many slots, so rank 0's slot numbers hold
    everywhere), and for a hybrid model (`state_slot_bytes`: one snapshot's) `STATE_SHARE` of
    it over a snapshot's bytes. (0, 0) when the tier is off or too small to hold `MIN_SLOTS`
    of each."""
    if config.prefix_cache_host_gib <= 0 or not config.prefix_cache:
        return 0, 0
    budget = int(config.prefix_cache_host_gib * GIB)
    states = int(budget * STATE_SHARE) // state_slot_bytes if state_slot_bytes else 0
    if state_slot_bytes and states < MIN_SLOTS:
        return 0, 0
    mtp = uses_mtp(config.speculative, model)
    specs = rank_cache_specs(model, tp_size, 0, mtp, config.kv_cache_dtype)
    block_bytes = kv_bytes_per_token(config, specs) * config.block_size
    blocks = (budget - states * state_slot_bytes) // max(block_bytes, 1)
    return (blocks, states) if blocks >= MIN_SLOTS else (0, 0)


class HostStore:
    """`pools` are this rank's cache tensors with the axis of their blocks."""

    def __init__(self, pools: Sequence[tuple[torch.Tensor, int]], num_slots: int) -> None:
        self.pools = list(pools)
        pin = any(pool.is_cuda for pool, _ in pools)
        self.hosts = []
        for pool, axis in pools:
            shape = list(pool.shape)
            shape[axis] = num_slots
            self.hosts.append(torch.empty(shape, dtype=pool.dtype, pin_memory=pin))
        self.disk: DiskStore | None = None  # the disk tier, whose ops come in the same list
        self.states: HostStore | None = None  # a hybrid model's snapshots' (ops from STATES)

    @property
    def num_bytes(self) -> int:
        return sum(host.numel() * host.element_size() for host in self.hosts)

    def run(self, copies: Sequence[Copy]) -> None:
        """Each copy in order: a device block spilled to a host slot, a host slot loaded into a
        device block, or one of the disk tier's ops."""
        for op, source, target in copies:
            if op >= STATES:
                assert self.states is not None, "a snapshot op without a snapshot tier"
                self.states.run(((op - STATES, source, target),))
                continue
            if op not in (SPILL, LOAD):
                assert self.disk is not None, "a disk-tier op without a disk tier"
                self.disk.run(op, source, target)
                continue
            for (pool, axis), host in zip(self.pools, self.hosts, strict=True):
                if op == SPILL:
                    host.select(axis, target).copy_(pool.select(axis, source))
                else:
                    pool.select(axis, target).copy_(host.select(axis, source))
