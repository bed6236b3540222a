"""The KV block pool: free blocks, reference counts, each request's block table, and the prefix
cache's share of the pool."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from dgpp.engine.cache.disk_tier import DiskTier
from dgpp.engine.cache.host_tier import Copy, HostTier
from dgpp.engine.cache.prefix_cache import (
    BlockTokens,
    HashPrefixCache,
    NullPrefixCache,
    PrefixCache,
    block_hashes,
)
from dgpp.engine.cache.sessions import SessionBook, SessionLru, SessionTable
from dgpp.engine.cache.snapshot_tiers import SnapshotTiers
from dgpp.engine.cache.state_snapshots import StateBook
from dgpp.engine.vision.spans import block_images, chunk_end

if TYPE_CHECKING:
    from dgpp.engine.scheduling.request import Request


class BlockPool:
    """Block ids with reference counts.

    Invariant: a block with reference count zero is either in the free list (uncached) or
    evictable in the prefix cache (cached, kept for future hits); both count as free space.
    """

    def __init__(self, num_blocks: int, cache: PrefixCache | None = None) -> None:
        self.num_blocks = num_blocks
        self.cache: PrefixCache = cache if cache is not None else NullPrefixCache()
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.cache.num_evictable

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks (reference count 1 each), evicting cached ones only when the free
        list runs short; the caller checked there are enough."""
        assert count <= self.num_free_blocks, "allocate() without enough free blocks"
        blocks = [self._free.popleft() for _ in range(min(count, len(self._free)))]
        if len(blocks) < count:
            blocks += self.cache.evict(count - len(blocks))
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def acquire(self, block: int) -> None:
        """Add a reference to a cached block another request found by prefix."""
        if self._ref_counts[block] == 0:
            self.cache.lock(block)
        self._ref_counts[block] += 1

    def release(self, blocks: list[int], session: str | None = None) -> None:
        """Drop one reference to each block (a request of `session` lets them go). Released
        last-to-first, so a request's tail blocks become evictable before its (more widely
        shared) head blocks."""
        for block in reversed(blocks):
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, "block released more often than referenced"
            if self._ref_counts[block] == 0:
                if self.cache.is_cached(block):
                    self.cache.unlock(block, session)
                else:
                    self._free.append(block)


class BlockManager:
    """Grows, shares and frees requests' block tables in a `BlockPool`, and for a model with
    recurrent layers (`states`) each request's state slot and the prefix cache's state
    snapshots: there a prefix hit reaches only as deep as the deepest snapshot."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        cache: PrefixCache | None = None,
        salt: int = 0,
        states: StateBook | None = None,
        host: HostTier | None = None,
        disk: DiskTier | None = None,
        state_tiers: tuple[HostTier, DiskTier | None] | None = None,
        sessions: SessionTable | None = None,
    ) -> None:
        """`host` and `disk`: the prefix cache's tiers below the device; `state_tiers` the
        host and disk tiers of a hybrid model's snapshots (without them such a model keeps
        neither: its hits need a snapshot)."""
        self.pool = BlockPool(num_blocks, cache)
        self.block_size = block_size
        self.salt = salt  # mixed into every block key: whatever else changes the KV (the model)
        self.states = states
        self.snapshot_tiers: SnapshotTiers | None = None
        if states is not None and state_tiers is not None and state_tiers[0].num_slots:
            self.snapshot_tiers = SnapshotTiers(states.snapshots, *state_tiers)
        tiered = states is None or self.snapshot_tiers is not None
        # The host tier keeps evicted blocks.
        self.host = host if tiered and host is not None and host.num_slots else None
        if self.host is not None and isinstance(self.cache, HashPrefixCache):
            self.cache.on_spill = self.host.spill
        self.disk = disk if self.host is not None else None  # staged through the host tier
        tiers: dict[str, SessionLru] = {}  # agent sessions' blocks given up last (`sessions`)
        if isinstance(self.cache, HashPrefixCache):
            tiers["device"] = self.cache.evictable
        if self.host is not None:
            tiers["host"] = self.host.order
        self.sessions = SessionBook(sessions if sessions is not None else SessionTable(), tiers)

    @property
    def cache(self) -> PrefixCache:
        return self.pool.cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_table))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens (and give the request a
        state slot if the model has recurrent layers); False if the pool is short."""
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        if self.states is not None and request.state_slot < 0:
            slot = self.states.slots.take()
            if slot is None:
                return False
            request.state_slot = slot
        request.block_table.extend(self.pool.allocate(needed))
        return True

    def match_prefix(self, request: Request) -> int:
        """Start a fresh request on its longest cached prefix: share those blocks and count their
        tokens as computed. The last known token is always recomputed (its logits are needed).
        Returns the number of tokens found."""
        assert not request.block_table and request.num_computed_tokens == 0
        if not request.use_prefix_cache or not self.cache.enabled:
            return 0
        size = self.block_size
        keys, blocks, found, reach = self._lookup(request)
        if self.states is not None:  # only as deep as a snapshot of the recurrent state
            self._snapshot_branch(request, reach * size)
            snapshot = self._find_snapshot(keys[:reach])
            reach = snapshot[0] if snapshot else 0
            request.restore_from = snapshot[1] if snapshot else None
        found = found[:reach]
        for block in found:
            self.pool.acquire(block)
        loaded = []
        if self.host is not None:
            loaded = self._load_from_host(request, blocks, len(found), reach)
        table = [*found, *(block for block, _ in loaded)]
        if self.states is not None and len(table) < reach:  # the pool ran short: a miss
            self.pool.release(table, request.session)
            table, loaded, request.restore_from = [], [], None
        request.block_table = table
        request.num_computed_tokens = len(table) * size
        request.num_hashed_blocks = len(table)
        request.num_host_tokens = len(loaded) * size
        request.num_disk_tokens = sum(from_disk for _, from_disk in loaded) * size
        if request.session is not None:
            self.sessions.table.record(
                request.session, request.num_prompt_tokens, request.num_computed_tokens
            )
        return request.num_computed_tokens

    def _lookup(self, request: Request) -> tuple[list[int], list[BlockTokens], list[int], int]:
        """The request's block keys and tokens (its usable full blocks: the last known token is
        always recomputed), the device blocks of its longest cached prefix, and how many blocks
        deep the prefix reaches with those the host tier holds after them."""
        size = self.block_size
        request.block_hashes = keys = self._keys(request)
        usable = (request.num_tokens - 1) // size
        tokens = request.token_ids
        blocks = [tuple(tokens[i * size : (i + 1) * size]) for i in range(usable)]
        found = self.cache.match(keys[:usable], blocks)
        reach = len(found)
        host = self.host
        while host is not None and reach < usable and host.holds(keys[reach], blocks[reach]):
            reach += 1
        return keys, blocks, found, reach

    def _find_snapshot(self, keys: list[int]) -> tuple[int, int] | None:
        assert self.states is not None
        if self.snapshot_tiers is not None:
            return self.snapshot_tiers.find(keys)
        return self.states.snapshots.find(keys)

    def arrive(self, request: Request) -> int:
        """A new request: its session is seen now, and its blocks past those the device and the
        host tier hold are fetched from the disk tier into host slots (the request waits for
        them, `disk_pending`); the number of fetches."""
        if request.session is not None:
            self.sessions.table.seen(request.session)
        if self.disk is None or not request.use_prefix_cache or request.block_table:
            return 0
        keys, blocks, _, start = self._lookup(request)
        count = self.disk.prefetch(request, blocks, start)
        if self.snapshot_tiers is not None and start + count:  # and a snapshot that deep
            count += self.snapshot_tiers.prefetch(request, keys[: start + count])
        return count

    @property
    def num_fetching(self) -> int:
        """Fetches from the disk tier every rank was told of and that are not settled."""
        return len(self.disk.fetching) if self.disk is not None else 0

    def settle_fetches(self, states: list[int]) -> None:
        """Every rank's word on the oldest fetches
        (`dgpp.engine.cache.disk_tier.DiskTier.settle`)."""
        if self.disk is not None and states:
            self.disk.settle(states)

    def _load_from_host(
        self, request: Request, blocks: list[BlockTokens], start: int, stop: int
    ) -> list[tuple[int, bool]]:
        """The request's blocks `start .. stop` (tokens `blocks[i]`) that the host tier holds,
        in order until the first it does not: each copied into a fresh device block (evicting,
        and so spilling, another when the free list is empty) and cached on the device again:
        (block, whether a fetch from disk had filled its host slot)."""
        assert self.host is not None
        keys, loaded = request.block_hashes, []
        for index in range(stop - 1, start - 1, -1):  # all the newest: no spill below reuses one
            self.host.find(keys[index], blocks[index])
        for index in range(start, stop):
            key, block_tokens = keys[index], blocks[index]
            slot = self.host.find(key, block_tokens)
            if slot is None or self.pool.num_free_blocks == 0:
                break
            (block,) = self.pool.allocate(1)
            from_disk = self.host.load(key, slot, block)
            self.cache.insert(key, block_tokens, block)
            loaded.append((block, from_disk))
        return loaded

    def take_copies(self) -> tuple[Copy, ...]:
        """The host-tier copies recorded since the last step message (every rank runs them)."""
        return self.host.take_copies() if self.host is not None else ()

    def begin_step(self) -> None:
        """At the start of a step's plan: sessions released meanwhile end, and the snapshots
        the last step saved go to the disk tier (before anything reuses their slots)."""
        self.sessions.apply_releases()
        if self.snapshot_tiers is not None:
            self.snapshot_tiers.record_writes()

    def cache_computed_blocks(self, request: Request) -> int:
        """Offer the request's newly computed full blocks to the cache; returns how many were
        added (a block whose key is already cached elsewhere is not)."""
        size = self.block_size
        full = request.num_computed_tokens // size
        if full <= request.num_hashed_blocks:
            return 0
        request.block_hashes = self._keys(request)
        added = 0
        keys = request.block_hashes
        for index in range(request.num_hashed_blocks, full):
            tokens = tuple(request.token_ids[index * size : (index + 1) * size])
            block = request.block_table[index]
            if self.cache.insert(keys[index], tokens, block):
                added += 1
                if self.disk is not None:  # written on every rank, kept across restarts
                    self.disk.save(keys[index], keys[index - 1] if index else 0, tokens, block)
        request.num_hashed_blocks = full
        return added

    def trim(self, request: Request) -> None:
        """Return the blocks past those the request's known tokens occupy (a rejected draft's).
        None of them is cached: they hold no computed token."""
        keep = -(-request.num_tokens // self.block_size)
        if len(request.block_table) > keep:
            self.pool.release(request.block_table[keep:], request.session)
            del request.block_table[keep:]

    def keep_accepted_state(self, request: Request, chunk_start: int, num_positions: int) -> None:
        """After a verify row of `num_positions` positions from `chunk_start`: when a draft was
        rejected, the request's recurrent state is the one after its last accepted position,
        kept in a draft slot; its next row copies it back first (`take_accepted_state`)."""
        if self.states is None or request.state_slot < 0:
            return
        position = request.num_computed_tokens - chunk_start - 1
        if position < num_positions - 1:
            request.accepted_state = self.states.layout.draft_slot(request.state_slot, position)

    def take_accepted_state(self, request: Request) -> tuple[int, int] | None:
        """(draft slot, request slot) to copy before the next forward, once."""
        if request.accepted_state is None:
            return None
        pair = (request.accepted_state, request.state_slot)
        request.accepted_state = None
        return pair

    def free(self, request: Request) -> None:
        self.pool.release(request.block_table, request.session)
        request.block_table = []
        request.num_computed_tokens = 0
        request.num_hashed_blocks = 0
        if self.states is not None and request.state_slot >= 0:
            self.states.slots.give(request.state_slot)
        request.state_slot = -1
        request.restore_from = None
        request.accepted_state = None

    def _snapshot_branch(self, request: Request, shared: int) -> None:
        """The request shares `shared` tokens of cached KV with an earlier one (a system
        prompt, a common history) and branches off there: snapshot its state at that point,
        so the next request sharing the prefix restores it (the radix tree's branch node)."""
        assert self.states is not None
        if request.snapshot_points and shared >= self.states.min_snapshot_tokens:
            request.snapshot_points = tuple(sorted({*request.snapshot_points, shared}))

    def take_restore(self, request: Request) -> tuple[int, int] | None:
        """(snapshot slot, request slot) to copy before the request's next chunk, once: the
        prefix hit `match_prefix` found, now that the request holds a slot."""
        if request.restore_from is None or self.states is None:
            return None
        assert request.state_slot >= 0, "restore before the request has a slot"
        pair = (request.restore_from, request.state_slot)
        request.restore_from = None
        self.states.snapshots.count_hit(request.num_computed_tokens // self.block_size)
        return pair

    def chunk_limit(self, request: Request, start: int, num_tokens: int) -> int:
        """`num_tokens`, or fewer so that a prefill chunk from `start` ends on the request's
        next snapshot point (its state there is saved after the step)."""
        for point in request.snapshot_points:
            if start < point < start + num_tokens:
                num_tokens = point - start
                break
        if request.images:  # and never inside an image (its tokens are encoded together)
            return chunk_end(request.image_spans, start, start + num_tokens) - start
        return num_tokens

    def snapshot_save(self, request: Request, end: int) -> tuple[int, int] | None:
        """(request slot, snapshot slot) to copy after a chunk that ends at `end`, when that is
        one of the request's snapshot points and no snapshot of that prefix is held yet."""
        if self.states is None or end not in request.snapshot_points:
            return None
        if not (request.fills_prefix_cache and self.cache.enabled):
            return None
        depth = end // self.block_size
        request.block_hashes = self._keys(request)
        key = request.block_hashes[depth - 1]
        slot = self.states.snapshots.reserve(key, depth)
        if slot is None:
            return None
        if self.snapshot_tiers is not None:
            self.snapshot_tiers.saved(key, slot)
        return request.state_slot, slot

    def _keys(self, request: Request) -> list[int]:
        """Each full block's key: its tokens' (and those before), and the digests of the
        images it holds (placeholder tokens are the same for every image)."""
        images = None
        if request.images:  # only the blocks not keyed yet
            num_blocks = len(request.token_ids) // self.block_size
            known = len(request.block_hashes)
            images = block_images(request.image_spans, self.block_size, num_blocks, known)
        return block_hashes(
            request.token_ids, self.block_size, self.salt, request.block_hashes, images
        )
