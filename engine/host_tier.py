"""The prefix cache's host tier, as rank 0 keeps it: which evicted blocks each host slot holds.

When the device pool evicts a cached block to reuse it, the block's contents (every cache kind
of every layer, on every rank) are copied to a slot of the host tier instead of being dropped,
and its key is kept here, least recently used first within `num_slots` slots. A later prefix
lookup that runs past the blocks still on the device goes on here: each block found is copied
back into a fresh device block and is a device-cached block again (the host copy stays: the
tiers are inclusive, so evicting it again costs no copy). The copies are recorded in order, as
(`SPILL`, device block, host slot) and (`LOAD`, host slot, device block), and every rank runs
them in that order before the step's forward (`HostStore`): a block evicted and reused in one
step is spilled before its new owner writes it, and a host slot reused in one step is read
before it is overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dgpp.engine.prefix_cache import BlockTokens

SPILL, LOAD = 0, 1
Copy = tuple[int, int, int]  # (SPILL, device block, host slot) or (LOAD, host slot, device block)


@dataclass
class TierCounters:
    """Cumulative host-tier counters (rank 0)."""

    spilled_blocks: int = 0  # device blocks copied to the host tier
    loaded_blocks: int = 0  # host blocks copied back for a prefix hit
    evicted_blocks: int = 0  # host slots reused for newer blocks


class HostTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: OrderedDict[int, tuple[BlockTokens, int]] = OrderedDict()  # key -> slot
        self._free = list(range(num_slots - 1, -1, -1))
        self.copies: list[Copy] = []  # recorded since the last step message took them
        self.counters = TierCounters()

    def __len__(self) -> int:
        return len(self._slots)

    def spill(self, key: int, tokens: BlockTokens, block: int) -> None:
        """The device evicts cached `block` (key `key`) for reuse: keep it here, unless it
        already is (then it is only the newest)."""
        if self.num_slots == 0:
            return
        if key in self._slots:
            self._slots.move_to_end(key)
            return
        if self._free:
            slot = self._free.pop()
        else:
            _, (_, slot) = self._slots.popitem(last=False)
            self.counters.evicted_blocks += 1
        self._slots[key] = (tokens, slot)
        self.copies.append((SPILL, block, slot))
        self.counters.spilled_blocks += 1

    def find(self, key: int, tokens: BlockTokens) -> int | None:
        """The host slot holding the block of `key` (its tokens confirmed), else None."""
        held = self._slots.get(key)
        if held is None or held[0] != tokens:
            return None
        self._slots.move_to_end(key)
        return held[1]

    def load(self, slot: int, block: int) -> None:
        """Copy host `slot` into device `block` before the next forward."""
        self.copies.append((LOAD, slot, block))
        self.counters.loaded_blocks += 1

    def take_copies(self) -> tuple[Copy, ...]:
        copies, self.copies = tuple(self.copies), []
        return copies
