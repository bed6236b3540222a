"""Rank 0's book of recurrent-state slots and snapshots: the deepest snapshot is found, the least
recently used goes first, a snapshot leaves with its KV block, and prefill chunks end on the
snapshot points."""

from __future__ import annotations

from dgpp.engine.backends.state_cache import StateLayout
from dgpp.engine.cache.block_manager import BlockManager
from dgpp.engine.cache.prefix_cache import HashPrefixCache
from dgpp.engine.cache.state_snapshots import SlotPool, SnapshotCache, StateBook, snapshot_points
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import PromptIds, Request


def test_the_deepest_snapshot_is_found_and_marked_used() -> None:
    cache = SnapshotCache(first_slot=4, num_slots=2, slot_bytes=100)
    assert cache.reserve(11, 1) == 4 and cache.reserve(33, 3) == 5
    assert cache.reserve(33, 3) is None  # held already
    assert cache.find([11, 22, 33, 44]) == (3, 5)
    assert cache.find([11, 22]) == (1, 4)
    assert cache.find([99]) is None
    # 11 was used last: a third snapshot evicts 33
    assert cache.reserve(55, 5) == 5
    assert 33 not in cache and 11 in cache
    stats = cache.stats()
    assert (stats.held, stats.bytes_held, stats.saved, stats.evicted) == (2, 200, 3, 1)


def test_no_snapshot_slots_keep_nothing() -> None:
    cache = SnapshotCache(first_slot=2, num_slots=0, slot_bytes=100)
    assert not cache.enabled and cache.reserve(1, 1) is None and cache.find([1]) is None


def test_slots_are_handed_out_and_given_back() -> None:
    pool = SlotPool(2)
    assert (pool.take(), pool.take(), pool.take()) == (0, 1, None)
    pool.give(0)
    assert pool.num_free == 1 and pool.take() == 0


def test_points_are_block_aligned_and_above_the_floor() -> None:
    assert snapshot_points(27, (21,), 4, 8) == (20, 24)
    assert snapshot_points(27, (5, 40), 4, 8) == (24,)  # below the floor; past the prompt
    assert snapshot_points(7, (), 4, 8) == ()


def _manager() -> tuple[BlockManager, StateBook, HashPrefixCache]:
    book = StateBook(StateLayout(100, num_running=2, num_snapshots=4), min_snapshot_tokens=8)
    cache = HashPrefixCache(on_evict=book.snapshots.drop)
    return BlockManager(4, 4, cache, salt=0, states=book), book, cache


def _request(name: str, tokens: list[int]) -> Request:
    request = Request(name, tokens, SamplingParams(), 4)
    request.snapshot_points = snapshot_points(len(tokens), (), 4, 8)
    return request


def test_chunks_end_on_points_and_a_snapshot_leaves_with_its_block() -> None:
    manager, book, cache = _manager()
    request = _request("a", list(range(13)))  # point 12
    assert manager.chunk_limit(request, 0, 13) == 12
    assert manager.allocate_slots(request, 12) and request.state_slot == 0
    request.num_computed_tokens = 12
    save = manager.snapshot_save(request, 12)
    assert save == (0, 2)  # request slot 0 into the first snapshot slot (after 2 running)
    manager.cache_computed_blocks(request)
    manager.free(request)
    assert book.slots.num_free == 2
    again = _request("b", list(range(13)))
    assert manager.match_prefix(again) == 12 and again.restore_from == 2
    manager.free(again)
    # all 4 blocks are needed by a new prompt: the cached ones are evicted, the snapshot too
    other = _request("c", list(range(100, 116)))
    assert manager.allocate_slots(other, 16)
    assert book.snapshots.stats().held == 0 and cache.num_evictions == 3


def test_prompt_ids_keep_their_hints_through_appending() -> None:
    prompt = PromptIds([1, 2, 3], (2,))
    longer = prompt + [4, 5]
    assert longer == [1, 2, 3, 4, 5] and longer.cache_hints == (2,)
