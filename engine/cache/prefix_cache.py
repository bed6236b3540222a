"""The prefix cache: full KV blocks keyed by a hash chained over their token ids.

A block's key covers its own tokens and, through the parent's key, every token before it (plus
a salt for anything else that changes the KV, such as the model), so equal keys mean equal
prefixes; a hit is still confirmed by comparing token ids, which guards against collisions.
Keys are the same in every process of one Python version (the hash of a tuple of ints is not
randomized, and the salt is a digest, `stable_salt`), so the disk tier
(`dgpp.engine.cache.disk_tier`) finds its files again after a restart.

The cache tracks which cached blocks are in use (referenced by a request) and which are
evictable (unreferenced, kept for future hits, oldest use first). Reference counts and the free
list stay in the `BlockPool`; `NullPrefixCache` is the cache turned off.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from dgpp.engine.cache.sessions import SessionLru, SessionTable

BlockTokens = tuple[int, ...]


@dataclass(frozen=True)
class PrefixCacheStats:
    num_cached_blocks: int  # blocks findable by key (in use or evictable)
    num_evictable_blocks: int  # of those, unreferenced: free space that may still hit
    num_evictions: int  # cumulative


def stable_salt(*parts: str) -> int:
    """A salt for block keys from `parts` (the checkpoint, the dtype): a digest, so equal in every
    process (Python's `hash` of a string is not)."""
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def chain_hash(parent: int | None, tokens: BlockTokens, salt: int) -> int:
    """The key of a full block whose predecessor has key `parent` (None for the first block;
    hashed as 0, since `hash(None)` differs between processes before Python 3.12)."""
    return hash((0 if parent is None else parent, tokens, salt))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: int,
    known: Sequence[int] = (),
    images: Mapping[int, tuple[int, ...]] | None = None,
) -> list[int]:
    """Keys of every full block of `token_ids`, extending the already computed `known` ones;
    `images`: what a block's key mixes in besides its tokens, by block index (the digests of
    the images it holds)."""
    keys = list(known)
    parent = keys[-1] if keys else None
    for start in range(len(keys) * block_size, len(token_ids) - block_size + 1, block_size):
        tokens = tuple(token_ids[start : start + block_size])
        if images and (extra := images.get(start // block_size)):
            tokens = (*tokens, *extra)
        parent = chain_hash(parent, tokens, salt)
        keys.append(parent)
    return keys


class PrefixCache(Protocol):
    @property
    def enabled(self) -> bool: ...

    @property
    def num_evictable(self) -> int:
        """Cached blocks that no request references (they count as free space)."""
        ...

    @property
    def num_evictions(self) -> int: ...

    def match(self, keys: Sequence[int], blocks_tokens: Sequence[BlockTokens]) -> list[int]:
        """Block ids of the longest cached prefix of a sequence whose full blocks have `keys` and
        token ids `blocks_tokens`. Changes nothing; the caller locks what it uses."""
        ...

    def lock(self, block_id: int) -> None:
        """A request starts referencing a cached block: it is no longer evictable."""
        ...

    def unlock(self, block_id: int, session: str | None = None) -> None:
        """The last reference to a cached block went away: it becomes the newest evictable (of
        `session`'s blocks, when a session's request let it go: `cache.sessions`)."""
        ...

    def insert(self, key: int, tokens: BlockTokens, block_id: int) -> bool:
        """Offer a computed, full, in-use block under `key`. False (nothing changes) when the key
        is already cached, in another block, or the cache is off."""
        ...

    def is_cached(self, block_id: int) -> bool: ...

    def evict(self, count: int) -> list[int]:
        """Remove up to `count` evictable blocks, in `SessionLru`'s order (anonymous ones least
        recently used first, then sessions' ones, the least recently seen session first), and
        return their ids for reuse. Never touches a block in use."""
        ...

    def stats(self) -> PrefixCacheStats: ...


class HashPrefixCache:
    """`on_evict(key)` is told each key that leaves the cache (the recurrent-state snapshots
    keyed by it become unreachable); `on_spill(key, tokens, block, session)` each evicted block
    before it is reused (the host tier keeps it, for its session)."""

    def __init__(
        self, on_evict: Callable[[int], None] | None = None, sessions: SessionTable | None = None
    ) -> None:
        self.on_evict = on_evict
        self.on_spill: Callable[[int, BlockTokens, int, str | None], None] | None = None
        self._by_key: dict[int, int] = {}
        self._key_of: dict[int, int] = {}
        self._tokens_of: dict[int, BlockTokens] = {}
        self.evictable: SessionLru[int] = SessionLru(
            sessions
        )  # block ids, in the order they are given up
        self._evictions = 0

    @property
    def enabled(self) -> bool:
        return True

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    @property
    def num_evictions(self) -> int:
        return self._evictions

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    def match(self, keys: Sequence[int], blocks_tokens: Sequence[BlockTokens]) -> list[int]:
        found = []
        for key, tokens in zip(keys, blocks_tokens, strict=False):
            block_id = self._by_key.get(key)
            if block_id is None or self._tokens_of[block_id] != tokens:
                break  # a miss, or a hash collision caught by the token comparison
            found.append(block_id)
        return found

    def lock(self, block_id: int) -> None:
        self.evictable.discard(block_id)

    def unlock(self, block_id: int, session: str | None = None) -> None:
        assert block_id in self._key_of, "unlock() of an uncached block"
        self.evictable.add(block_id, session)

    def insert(self, key: int, tokens: BlockTokens, block_id: int) -> bool:
        if key in self._by_key or block_id in self._key_of:
            return False
        self._by_key[key] = block_id
        self._key_of[block_id] = key
        self._tokens_of[block_id] = tokens
        return True

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._key_of

    def evict(self, count: int) -> list[int]:
        evicted: list[int] = []
        while len(evicted) < count and (popped := self.evictable.pop()) is not None:
            block_id, session = popped
            key = self._key_of.pop(block_id)
            del self._by_key[key]
            tokens = self._tokens_of.pop(block_id)
            if self.on_spill is not None:
                self.on_spill(key, tokens, block_id, session)
            if self.on_evict is not None:
                self.on_evict(key)
            evicted.append(block_id)
        self._evictions += len(evicted)
        return evicted

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(len(self._by_key), len(self.evictable), self._evictions)


class NullPrefixCache:
    """The cache turned off: nothing is found, kept or evicted."""

    @property
    def enabled(self) -> bool:
        return False

    @property
    def num_evictable(self) -> int:
        return 0

    @property
    def num_evictions(self) -> int:
        return 0

    def match(self, keys: Sequence[int], blocks_tokens: Sequence[BlockTokens]) -> list[int]:
        return []

    def lock(self, block_id: int) -> None:
        pass

    def unlock(self, block_id: int, session: str | None = None) -> None:
        raise AssertionError("NullPrefixCache holds no blocks")

    def insert(self, key: int, tokens: BlockTokens, block_id: int) -> bool:
        return False

    def is_cached(self, block_id: int) -> bool:
        return False

    def evict(self, count: int) -> list[int]:
        return []

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(0, 0, 0)
