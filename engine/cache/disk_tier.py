"""The prefix cache's disk tier, as rank 0 keeps it: which blocks have files, and the fetches in
flight.

Every block the prefix cache takes in is also written to a file on every rank (`SAVE`, its
shard there; `dgpp.engine.cache.disk_store`), so the files outlive the process: after a restart rank
0 reads its files' headers back into this index and an agent's next turn hits. The index holds
`num_blocks` blocks, least recently used first; a block it forgets is deleted on every rank
(`DROP`).

A new request's blocks past those the device and the host tier hold are looked up here when it
arrives: each block found gets a reserved host slot and a `FETCH` (every rank reads its file
there, in the background), and the request waits, out of the step, until every fetch of its
has been settled. Settling takes every rank's word (`dgpp.engine.cache.disk_store.agreed_states`): a
block read and checked on every rank becomes a host-tier block (the request's admission loads
it like any other), one missing, truncated or corrupt on any rank is a miss, and its files are
dropped.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dgpp.engine.cache.host_tier import DROP, FETCH, SAVE, HostTier
from dgpp.engine.cache.prefix_cache import BlockTokens
from dgpp.engine.cache.tier_file import BlockHeader

if TYPE_CHECKING:
    from dgpp.engine.scheduling.request import Request

OK, PENDING, FAILED = 0, 1, 2  # a fetch's state, agreed by every rank


@dataclass
class DiskCounters:
    """Cumulative disk-tier counters (rank 0)."""

    saved_blocks: int = 0  # blocks written (or queued to be) on every rank
    unsaved_blocks: int = 0  # writes rank 0's store could not make (backlog, full disk)
    fetched_blocks: int = 0  # blocks read back into the host tier on every rank
    failed_blocks: int = 0  # fetches that failed on some rank: missing, truncated, corrupt
    dropped_blocks: int = 0  # blocks the index forgot for newer ones (files deleted)


@dataclass(frozen=True)
class Fetch:
    key: int
    tokens: BlockTokens
    slot: int
    request: Request
    tier: DiskTier  # whose index and host tier it settles into


class DiskTier:
    def __init__(
        self,
        host: HostTier,
        num_blocks: int,
        found: Iterable[BlockHeader] = (),
        fetching: list[Fetch] | None = None,
    ) -> None:
        """`found`: the headers of the files rank 0 already holds (oldest first); `fetching`:
        the fetches in flight, a list shared with the other disk tier (a hybrid model's
        snapshots), in the order every rank was told."""
        self.host = host
        self.num_blocks = num_blocks
        self._index: OrderedDict[int, tuple[int, BlockTokens]] = OrderedDict()
        for header in found:
            self._index[header.key] = (header.parent, header.tokens)
        while len(self._index) > num_blocks:
            self._forget(next(iter(self._index)))
        self.fetching: list[Fetch] = fetching if fetching is not None else []
        self.unsaved: deque[int] = deque()  # keys rank 0's store did not write (its thread)
        self.counters = DiskCounters()

    def __len__(self) -> int:
        return len(self._index)

    def meta(self, key: int) -> tuple[int, BlockTokens] | None:
        """(parent key, tokens) of an indexed block: what rank 0 writes in its file header."""
        return self._index.get(key)

    def save(self, key: int, parent: int, tokens: BlockTokens, block: int) -> None:
        """The prefix cache took in device `block` under `key`: write it, unless it has a file."""
        self._take_unsaved()
        if self.num_blocks == 0:
            return
        if key in self._index:
            self._index.move_to_end(key)
            return
        while len(self._index) >= self.num_blocks:
            self._forget(next(iter(self._index)))
            self.counters.dropped_blocks += 1
        self._index[key] = (parent, tokens)
        self.host.record(SAVE, block, key)
        self.counters.saved_blocks += 1

    def prefetch(self, request: Request, blocks: list[BlockTokens], start: int) -> int:
        """Fetch the request's blocks from `start` on (their tokens `blocks[i]`, keys in
        `request.block_hashes`) that the index holds, in order until the first it does not or
        no host slot is left; the number of fetches. The request waits for them."""
        self._take_unsaved()
        keys = request.block_hashes
        count = 0
        for index in range(start, len(blocks)):
            key, parent = keys[index], keys[index - 1] if index else 0
            if not self.holds(key, parent, blocks[index]):
                break  # not on disk (or a key collision: another chain, other tokens)
            if not self.fetch(request, key, blocks[index]):
                break
            count += 1
        return count

    def holds(self, key: int, parent: int = 0, tokens: BlockTokens = ()) -> bool:
        return self._index.get(key) == (parent, tokens)

    def fetch(self, request: Request, key: int, tokens: BlockTokens) -> bool:
        """Read the indexed block of `key` into a reserved host slot for `request` (which waits
        for it); False when no host slot is left."""
        slot = self.host.reserve()
        if slot is None:
            return False
        self._index.move_to_end(key)
        self.host.record(FETCH, key, slot)
        self.fetching.append(Fetch(key, tokens, slot, request, self))
        request.disk_pending += 1
        return True

    def settle(self, states: list[int]) -> None:
        """Every rank's word on the oldest `len(states)` fetches (of every disk tier sharing
        the list): each OK, PENDING or FAILED."""
        assert len(states) <= len(self.fetching), "a fetch settled twice"
        waiting = []
        for fetch, state in zip(self.fetching, states, strict=False):
            if state == PENDING:
                waiting.append(fetch)
            else:
                fetch.request.disk_pending -= 1
                fetch.tier._settled(fetch, state == OK)
        self.fetching[: len(states)] = waiting

    def _settled(self, fetch: Fetch, ok: bool) -> None:
        if ok:
            self.host.commit(fetch.key, fetch.tokens, fetch.slot)
            self.counters.fetched_blocks += 1
            return
        # Missing, truncated or corrupt on some rank: a miss, and its files go.
        self.host.release(fetch.slot)
        self.counters.failed_blocks += 1
        if fetch.key in self._index:
            self._forget(fetch.key)

    def _forget(self, key: int) -> None:
        del self._index[key]
        self.host.record(DROP, key, 0)

    def _take_unsaved(self) -> None:
        while self.unsaved:
            key = self.unsaved.popleft()
            self.counters.unsaved_blocks += 1
            if key in self._index:
                self._forget(key)
