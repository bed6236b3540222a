"""A hybrid model's recurrent-state snapshots in the prefix cache's host and disk tiers (rank 0).

A prefix hit on a hybrid model needs the KV blocks of its attention layers and a snapshot of
every recurrent layer's state at the hit's depth (`dgpp.engine.cache.state_snapshots`). With the
tiers, a snapshot the device drops (its slot wanted, or its block evicted) is copied to a host
snapshot slot instead, and every snapshot saved is also written to disk; a lookup takes the
deepest snapshot any tier holds among the blocks it can bring back, and one found below the
device is copied into a device snapshot slot before the request's state is restored from it.
The ops are the block tiers' (`dgpp.engine.cache.host_tier`), numbered from `STATES`, in the same
ordered list; a snapshot's disk write goes out at the next step (the step that saved it
computes it in its forward, after that step's copies ran).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dgpp.engine.cache.disk_tier import DiskTier
from dgpp.engine.cache.host_tier import HostTier
from dgpp.engine.cache.state_snapshots import SnapshotCache

if TYPE_CHECKING:
    from dgpp.engine.scheduling.request import Request

_NO_TOKENS: tuple[int, ...] = ()  # a snapshot is found by its key alone (its blocks by tokens)


class SnapshotTiers:
    def __init__(self, snapshots: SnapshotCache, host: HostTier, disk: DiskTier | None) -> None:
        self.snapshots = snapshots
        self.host = host
        self.disk = disk
        self._writes: list[tuple[int, int]] = []  # (key, device slot) saved by the last step
        snapshots.on_spill = self.spill

    def spill(self, key: int, slot: int) -> None:
        """The device drops the snapshot of `key` in `slot`: keep it in the host tier."""
        self.host.spill(key, _NO_TOKENS, slot)

    def saved(self, key: int, slot: int) -> None:
        """A snapshot of `key` goes into device `slot` in this step: write it after."""
        if self.disk is not None:
            self._writes.append((key, slot))

    def record_writes(self) -> None:
        """The last step's snapshots, to disk (before anything this step reuses their slots)."""
        assert self.disk is not None or not self._writes
        for key, slot in self._writes:
            if key in self.snapshots and self.disk is not None:
                self.disk.save(key, 0, _NO_TOKENS, slot)
        self._writes.clear()

    def find(self, keys: Sequence[int]) -> tuple[int, int] | None:
        """The deepest snapshot on the device or in the host tier among the prefix of blocks
        `keys`: (depth in blocks, device snapshot slot); one from the host tier is copied into
        a device snapshot slot first. None when no tier holds one."""
        for depth in range(len(keys), 0, -1):
            key = keys[depth - 1]
            if key in self.snapshots:
                return self.snapshots.find(keys[:depth])
            held = self.host.find(key, _NO_TOKENS)  # the newest: the spill below keeps it
            if held is None:
                continue
            slot = self.snapshots.reserve(key, depth)  # may drop (spill) the oldest
            if slot is None:
                continue
            self.host.load(key, held, slot)
            return depth, slot
        return None

    def prefetch(self, request: Request, keys: Sequence[int]) -> bool:
        """Fetch the deepest snapshot among the prefix of blocks `keys` (those the tiers will
        hold) from disk, unless the device or the host tier holds one as deep."""
        if self.disk is None:
            return False
        for depth in range(len(keys), 0, -1):
            key = keys[depth - 1]
            if key in self.snapshots or self.host.holds(key, _NO_TOKENS):
                return False
            if self.disk.holds(key):
                return self.disk.fetch(request, key, _NO_TOKENS)
        return False
