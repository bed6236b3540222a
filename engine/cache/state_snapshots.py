"""Rank 0's book of state slots: which running request holds which slot, and the prefix
cache's snapshots of recurrent state.

A recurrent layer's state cannot be rebuilt from cached KV: a prefix hit on a hybrid model is
possible only where a snapshot of every recurrent layer's state was kept at that boundary. A
snapshot is keyed by the chained hash of the last full KV block it covers (`prefix_cache`), so
it is found through the same keys as the KV blocks: a hit takes the deepest snapshot whose
blocks are all still cached, restores it into the request's slot, and computes the rest.
Snapshots are placed at block-aligned positions the scheduler makes prefill chunks end on: the
last full block of each prompt (an agent's next turn extends it), positions the caller hints
(the end of a system prompt), and where a prompt branches off a cached prefix it shares with an
earlier request (a radix tree's branch node: the next request sharing that prefix, a system
prompt or a common history, restores it); never below `prefix_min_tokens`.
Their budget is a number of slots (`prefix_cache_gib` divided by one slot's bytes); the least
recently used snapshot goes first, and one whose last block left the KV cache goes at once.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dgpp.engine.backends.state_cache import StateLayout


class SlotPool:
    """Slot ids for running requests: every request being served holds exactly one."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        assert slot not in self._free, "state slot freed twice"
        self._free.append(slot)


@dataclass
class SnapshotStats:
    held: int = 0  # snapshots findable now
    bytes_held: int = 0
    saved: int = 0  # cumulative
    evicted: int = 0  # cumulative: LRU, or their last block left the KV cache
    hits: int = 0  # restores
    hits_by_depth: Counter[int] = field(default_factory=Counter)  # restores by depth in blocks


class SnapshotCache:
    """Snapshot slots `first_slot ..` (after the running ones), keyed by block hash."""

    def __init__(self, first_slot: int, num_slots: int, slot_bytes: int) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # key -> slot, least recent first
        self._depth_of: dict[int, int] = {}  # key -> blocks covered
        self._saved = self._evicted = self._hits = 0
        self._hits_by_depth: Counter[int] = Counter()
        # Told each snapshot dropped, (key, slot), before its slot is reused: the host tier
        # keeps it (`dgpp.engine.cache.snapshot_tiers`).
        self.on_spill: Callable[[int, int], None] | None = None

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    def __contains__(self, key: int) -> bool:
        return key in self._slot_of

    def find(self, keys: Sequence[int]) -> tuple[int, int] | None:
        """The deepest snapshot among a prefix whose full blocks (all cached) have `keys`:
        (depth in blocks, slot), marked as just used; None when there is none."""
        for depth in range(len(keys), 0, -1):
            slot = self._slot_of.get(keys[depth - 1])
            if slot is not None:
                self._slot_of.move_to_end(keys[depth - 1])
                return depth, slot
        return None

    def count_hit(self, depth: int) -> None:
        self._hits += 1
        self._hits_by_depth[depth] += 1

    def reserve(self, key: int, depth: int) -> int | None:
        """A slot to save the state at block `depth` (key `key`) into after this step,
        evicting the least recently used snapshot when none is free. None when the key is
        already held or there are no snapshot slots."""
        if not self.num_slots or key in self._slot_of:
            return None
        if not self._free:
            oldest = next(iter(self._slot_of))
            self.drop(oldest)
        slot = self._free.pop()
        self._slot_of[key] = slot
        self._depth_of[key] = depth
        self._saved += 1
        return slot

    def drop(self, key: int) -> None:
        """Forget the snapshot of `key` (evicted, or its block left the KV cache)."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return
        if self.on_spill is not None:
            self.on_spill(key, slot)
        del self._depth_of[key]
        self._free.append(slot)
        self._evicted += 1

    def clear(self) -> None:
        for key in list(self._slot_of):
            self.drop(key)

    def stats(self) -> SnapshotStats:
        held = len(self._slot_of)
        return SnapshotStats(
            held,
            held * self.slot_bytes,
            self._saved,
            self._evicted,
            self._hits,
            Counter(self._hits_by_depth),
        )


def snapshot_points(
    num_prompt_tokens: int, hints: Sequence[int], block_size: int, min_tokens: int
) -> tuple[int, ...]:
    """Positions (ascending) after which a request's state is snapshotted: the last full block
    of its prompt and each hinted position (the end of the system prompt), rounded down to a
    block boundary; none below `min_tokens` or below one block."""
    floor = max(min_tokens, block_size)
    points = {num_prompt_tokens // block_size * block_size}
    points.update(hint // block_size * block_size for hint in hints if hint <= num_prompt_tokens)
    return tuple(sorted(point for point in points if point >= floor))


class StateBook:
    """The running slots and the snapshots of one state layout (`StateLayout`); no snapshot
    is placed below `min_snapshot_tokens` (the prefix cache's floor, at least one block).
    With speculative decoding each running slot has `draft_depth` draft slots after those."""

    def __init__(self, layout: StateLayout, min_snapshot_tokens: int = 1) -> None:
        self.layout = layout
        self.slots = SlotPool(layout.num_running)
        self.snapshots = SnapshotCache(layout.num_running, layout.num_snapshots, layout.slot_bytes)
        self.min_snapshot_tokens = max(1, min_snapshot_tokens)
