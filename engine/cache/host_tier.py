"""The prefix cache's host tier, as rank 0 keeps it: which evicted blocks each host slot holds.

When the device pool evicts a cached block to reuse it, the block's contents (every cache kind
of every layer, on every rank) are copied to a slot of the host tier instead of being dropped,
and its key is kept here within `num_slots` slots, given up in `SessionLru`'s order (anonymous
blocks least recently used first, then agent sessions' blocks, the least recently seen session
first: `dgpp.engine.cache.sessions`). A later prefix
lookup that runs past the blocks still on the device goes on here: each block found is copied
back into a fresh device block and is a device-cached block again (the host copy stays: the
tiers are inclusive, so evicting it again costs no copy). The copies are recorded in order, as
(`SPILL`, device block, host slot) and (`LOAD`, host slot, device block), and every rank runs
them in that order before the step's forward (`HostStore`): a block evicted and reused in one
step is spilled before its new owner writes it, and a host slot reused in one step is read
before it is overwritten. With a disk tier (`dgpp.engine.cache.disk_tier`) its ops go to the same
ordered list, and a block fetched from disk lands in a host slot reserved for it here.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgpp.engine.cache.prefix_cache import BlockTokens
from dgpp.engine.cache.sessions import SessionLru

SPILL, LOAD = 0, 1  # the host tier's copies
SAVE, FETCH, DROP = 2, 3, 4  # the disk tier's: (SAVE, device block, key), (FETCH, key, host
# slot), (DROP, key, 0)
Copy = tuple[int, int, int]  # (SPILL, device block, host slot) or (LOAD, host slot, device block)
# Hybrid models tier their recurrent-state snapshots too, with the same ops on state slots:
# those ops are numbered from STATES (STATES + SPILL: device snapshot slot -> host slot, ...).
STATES = 8


@dataclass
class TierCounters:
    """Cumulative host-tier counters (rank 0)."""

    spilled_blocks: int = 0  # device blocks copied to the host tier
    loaded_blocks: int = 0  # host blocks copied back for a prefix hit
    evicted_blocks: int = 0  # host slots reused for newer blocks


class HostTier:
    def __init__(self, num_slots: int, base: int = 0, copies: list[Copy] | None = None) -> None:
        """`base`: what the ops it records are numbered from (0, or STATES for snapshots);
        `copies`: the ordered list it records into, shared with the other tiers."""
        self.num_slots = num_slots
        self.base = base
        self._slots: dict[int, tuple[BlockTokens, int]] = {}  # key -> (tokens, slot)
        self.order: SessionLru[int] = SessionLru()  # the keys, in the order they are given up
        self._free = list(range(num_slots - 1, -1, -1))
        # Recorded since the last step message took them.
        self.copies: list[Copy] = copies if copies is not None else []
        self.counters = TierCounters()
        self.from_disk: set[int] = set()  # keys whose slots a disk fetch filled, not yet loaded

    def __len__(self) -> int:
        return len(self._slots)

    def spill(self, key: int, tokens: BlockTokens, block: int, session: str | None = None) -> None:
        """The device evicts cached `block` (key `key`, last used by `session`) for reuse: keep
        it here, unless it already is (then it is only the newest)."""
        if self.num_slots == 0:
            return
        if key in self._slots:
            self.order.add(key, session)
            return
        if not self._free and not self.order.yields_to(session):
            return  # every slot holds a block a session keeps ahead of this one: dropped
        slot = self.reserve()
        if slot is None:  # every slot is reserved for a fetch from disk
            return
        self._slots[key] = (tokens, slot)
        self.order.add(key, session)
        self.record(SPILL, block, slot)
        self.counters.spilled_blocks += 1

    def reserve(self) -> int | None:
        """A slot for a new block (the least recently used one's when none is free), out of
        the index until `commit` or `release`; None when every slot is reserved."""
        if self._free:
            return self._free.pop()
        popped = self.order.pop()
        if popped is None:
            return None
        key = popped[0]
        _, slot = self._slots.pop(key)
        self.from_disk.discard(key)
        self.counters.evicted_blocks += 1
        return slot

    def commit(self, key: int, tokens: BlockTokens, slot: int) -> None:
        """Reserved `slot` now holds the block of `key`, fetched from disk."""
        if key in self._slots:  # spilled from the device meanwhile: that copy is as good
            self.release(slot)
            return
        self._slots[key] = (tokens, slot)
        self.order.add(key)
        self.from_disk.add(key)

    def release(self, slot: int) -> None:
        """A reserved slot goes back unused (its fetch failed)."""
        self._free.append(slot)

    def holds(self, key: int, tokens: BlockTokens) -> bool:
        """Whether the tier holds the block of `key` (its tokens confirmed); touches nothing."""
        held = self._slots.get(key)
        return held is not None and held[0] == tokens

    def find(self, key: int, tokens: BlockTokens) -> int | None:
        """The host slot holding the block of `key` (its tokens confirmed), else None."""
        held = self._slots.get(key)
        if held is None or held[0] != tokens:
            return None
        self.order.touch(key)
        return held[1]

    def load(self, key: int, slot: int, block: int) -> bool:
        """Copy host `slot` (found for `key`) into device `block` before the next forward; True
        when a fetch from disk filled the slot."""
        self.record(LOAD, slot, block)
        self.counters.loaded_blocks += 1
        if key in self.from_disk:
            self.from_disk.discard(key)
            return True
        return False

    def record(self, op: int, a: int, b: int) -> None:
        self.copies.append((self.base + op, a, b))

    def take_copies(self) -> tuple[Copy, ...]:
        copies = tuple(self.copies)
        self.copies.clear()  # the list the other tiers record into too
        return copies
