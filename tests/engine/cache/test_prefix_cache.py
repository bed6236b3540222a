"""Unit tests of the prefix cache and its share of the block pool (no model)."""

from __future__ import annotations

import pytest

from dgpp.engine.cache.block_manager import BlockManager, BlockPool
from dgpp.engine.cache.prefix_cache import (
    HashPrefixCache,
    NullPrefixCache,
    block_hashes,
    chain_hash,
)
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import Request

BLOCK = 4


def test_keys_are_chained_over_the_whole_prefix() -> None:
    tokens = list(range(100, 117))  # 4 full blocks + 1 token
    keys = block_hashes(tokens, BLOCK, salt=7)
    assert len(keys) == 4
    assert keys == block_hashes([*tokens, 1, 2], BLOCK, salt=7)[:4]  # later tokens don't matter
    changed = [999, *tokens[1:]]  # only the very first token differs...
    assert all(a != b for a, b in zip(keys, block_hashes(changed, BLOCK, 7), strict=True))
    assert block_hashes(tokens, BLOCK, salt=8)[0] != keys[0]  # ...or only the salt (model)
    assert keys[1] == chain_hash(keys[0], tuple(tokens[4:8]), 7)
    assert block_hashes(tokens, BLOCK, 7, known=keys[:2]) == keys  # extends known keys


def test_a_key_collision_is_caught_by_comparing_tokens() -> None:
    cache = HashPrefixCache()
    assert cache.insert(key=42, tokens=(1, 2, 3, 4), block_id=0)
    assert cache.match([42], [(1, 2, 3, 4)]) == [0]
    assert cache.match([42], [(9, 9, 9, 9)]) == []  # same key, other tokens: no hit
    assert not cache.insert(key=42, tokens=(1, 2, 3, 4), block_id=1)  # key already cached


def test_match_stops_at_the_first_miss() -> None:
    cache = HashPrefixCache()
    cache.insert(1, (1,), 10)
    cache.insert(3, (3,), 30)
    assert cache.match([1, 2, 3], [(1,), (2,), (3,)]) == [10]


def test_eviction_is_least_recently_used_and_skips_locked_blocks() -> None:
    cache = HashPrefixCache()
    for block in range(4):
        cache.insert(100 + block, (block,), block)
    for block in (2, 0, 3, 1):  # unlock order = recency order
        cache.unlock(block)
    cache.lock(3)  # a request took block 3 again: it must survive eviction
    assert cache.evict(2) == [2, 0]
    assert cache.evict(10) == [1]
    assert cache.is_cached(3) and not cache.is_cached(2)
    assert cache.match([103], [(3,)]) == [3] and cache.match([102], [(2,)]) == []
    assert cache.num_evictions == 3
    stats = cache.stats()
    assert (stats.num_cached_blocks, stats.num_evictable_blocks, stats.num_evictions) == (1, 0, 3)


def test_null_cache_finds_and_keeps_nothing() -> None:
    cache = NullPrefixCache()
    assert not cache.insert(1, (1,), 0)
    assert cache.match([1], [(1,)]) == [] and cache.evict(5) == []
    assert not cache.enabled and cache.num_evictable == 0
    assert cache.stats().num_cached_blocks == 0


def test_pool_counts_evictable_blocks_as_free_and_evicts_only_when_short() -> None:
    cache = HashPrefixCache()
    pool = BlockPool(4, cache)
    blocks = pool.allocate(2)
    cache.insert(5, (5,), blocks[0])
    pool.release(blocks)  # blocks[0] stays cached (evictable), blocks[1] returns to the free list
    assert pool.num_free_blocks == 4 and cache.num_evictable == 1
    assert pool.allocate(3) and cache.is_cached(blocks[0])  # three uncached blocks suffice
    assert pool.allocate(1) == [blocks[0]] and not cache.is_cached(blocks[0])  # now evicted


def _request(tokens: list[int], use_cache: bool = True) -> Request:
    request = Request("r", tokens, SamplingParams(), max_tokens=4)
    request.use_prefix_cache = use_cache
    return request


def test_block_manager_shares_a_cached_prefix_and_recomputes_the_last_token() -> None:
    manager = BlockManager(16, BLOCK, HashPrefixCache(), salt=1)
    first = _request(list(range(12)))  # exactly 3 blocks
    assert manager.match_prefix(first) == 0
    assert manager.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    assert manager.cache_computed_blocks(first) == 3
    same = _request(list(range(12)))
    # All 3 blocks are cached, but the last token must be recomputed: only 2 blocks are used.
    assert manager.match_prefix(same) == 8 and same.block_table == first.block_table[:2]
    longer = _request(list(range(14)))
    assert manager.match_prefix(longer) == 12 and longer.block_table == first.block_table
    opted_out = _request(list(range(14)), use_cache=False)
    assert manager.match_prefix(opted_out) == 0 and opted_out.block_table == []
    for request in (first, same, longer):
        manager.free(request)
    assert manager.num_used_blocks == 0 and manager.cache.num_evictable == 3


@pytest.mark.parametrize("cache", [HashPrefixCache(), NullPrefixCache()], ids=["hash", "null"])
def test_a_full_pool_evicts_cache_rather_than_failing(cache: object) -> None:
    manager = BlockManager(4, BLOCK, cache, salt=1)  # type: ignore[arg-type]
    for start in range(0, 40, 8):  # each request fills the whole pool with new blocks
        request = _request(list(range(start, start + 16)))
        manager.match_prefix(request)
        assert manager.allocate_slots(request, request.num_pending_tokens)
        request.num_computed_tokens = 16
        manager.cache_computed_blocks(request)
        manager.free(request)
    assert manager.num_used_blocks == 0
