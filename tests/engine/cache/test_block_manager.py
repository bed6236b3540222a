"""The KV block pool and block tables: counts, growth across block boundaries, all-or-nothing
allocation, freeing, and the reference-count / free-list invariant. No model is loaded."""

from __future__ import annotations

import pytest

from dgpp.engine.cache.block_manager import BlockManager, BlockPool
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import Request


def make_request(request_id: str = "r", prompt_len: int = 4) -> Request:
    return Request(request_id, list(range(10, 10 + prompt_len)), SamplingParams(), 8)


def assert_free_list_invariant(pool: BlockPool) -> None:
    """A block is in the free list exactly when its reference count is zero, and only once."""
    free = list(pool._free)
    assert len(free) == len(set(free))
    for block in range(pool.num_blocks):
        assert (block in free) == (pool._ref_counts[block] == 0), block
        assert pool._ref_counts[block] >= 0


# --- BlockPool ---------------------------------------------------------------------------------


def test_new_pool_is_all_free() -> None:
    pool = BlockPool(8)
    assert pool.num_blocks == 8
    assert pool.num_free_blocks == 8
    assert_free_list_invariant(pool)


def test_allocate_takes_distinct_blocks_and_counts_them() -> None:
    pool = BlockPool(8)
    first = pool.allocate(3)
    second = pool.allocate(5)
    assert len(first) == 3 and len(second) == 5
    assert sorted(first + second) == list(range(8))  # every block handed out exactly once
    assert pool.num_free_blocks == 0
    assert pool.allocate(0) == []
    assert_free_list_invariant(pool)


def test_allocate_more_than_free_trips_the_assertion() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(AssertionError, match="without enough free blocks"):
        pool.allocate(2)


def test_release_of_blocks_allocated_once_frees_them() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    assert_free_list_invariant(pool)
    pool.release(blocks[:2])
    assert pool.num_free_blocks == 4
    assert_free_list_invariant(pool)
    pool.release(blocks[2:])
    assert pool.num_free_blocks == 6
    assert_free_list_invariant(pool)
    # Released blocks can be handed out again.
    assert sorted(pool.allocate(6)) == list(range(6))


def test_double_release_trips_the_assertion() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.release(blocks)
    with pytest.raises(AssertionError, match="released more often than referenced"):
        pool.release(blocks[:1])


def test_releasing_a_never_allocated_block_trips_the_assertion() -> None:
    pool = BlockPool(4)
    with pytest.raises(AssertionError, match="released more often than referenced"):
        pool.release([2])


def test_same_block_twice_in_one_release_trips_the_assertion() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.release([block, block])


# --- BlockManager ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_new_tokens", "expected"),
    [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4), (17, 5)],
)
def test_blocks_needed_for_a_fresh_request(num_new_tokens: int, expected: int) -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    assert manager.blocks_needed(make_request(), num_new_tokens) == expected


def test_blocks_needed_counts_only_what_the_table_lacks() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    request = make_request()
    assert manager.allocate_slots(request, 3)  # tokens 0..2 -> one block
    request.num_computed_tokens = 3
    assert len(request.block_table) == 1
    assert manager.blocks_needed(request, 1) == 0  # token 3 still fits block 0
    assert manager.blocks_needed(request, 2) == 1  # token 4 crosses into a second block
    assert manager.blocks_needed(request, 5) == 1  # tokens 3..7 end exactly on block 1
    assert manager.blocks_needed(request, 6) == 2  # token 8 needs a third block
    request.num_computed_tokens = 4
    assert manager.blocks_needed(request, 1) == 1  # token 4: a block boundary


def test_allocate_slots_grows_the_table_one_block_per_boundary() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request()
    sizes = []
    for _ in range(13):  # decode-like growth, one token at a time
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        sizes.append(len(request.block_table))
    assert sizes == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert manager.num_used_blocks == 4
    assert manager.num_free_blocks == 4
    assert len(set(request.block_table)) == 4


def test_allocate_slots_fails_cleanly_when_the_pool_is_short() -> None:
    manager = BlockManager(num_blocks=5, block_size=4)
    holder = make_request("holder")
    assert manager.allocate_slots(holder, 8)  # 2 blocks
    request = make_request("r")
    assert manager.allocate_slots(request, 4)  # 1 block
    request.num_computed_tokens = 4
    table_before = list(request.block_table)
    # 12 more tokens need 3 more blocks; only 2 are free: nothing may be taken.
    assert not manager.allocate_slots(request, 12)
    assert request.block_table == table_before
    assert request.num_computed_tokens == 4
    assert manager.num_free_blocks == 2
    assert manager.num_used_blocks == 3
    assert_free_list_invariant(manager.pool)
    # What does fit still succeeds, and uses up the pool exactly.
    assert manager.allocate_slots(request, 8)
    assert len(request.block_table) == 3
    assert manager.num_free_blocks == 0
    assert not manager.allocate_slots(make_request("late"), 1)


def test_free_returns_every_block_and_resets_the_request() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    first, second = make_request("a"), make_request("b")
    assert manager.allocate_slots(first, 5)  # 3 blocks
    assert manager.allocate_slots(second, 4)  # 2 blocks
    first.num_computed_tokens = 5
    assert not set(first.block_table) & set(second.block_table)
    second_table = list(second.block_table)
    manager.free(first)
    assert first.block_table == []
    assert first.num_computed_tokens == 0
    assert manager.num_used_blocks == 2
    assert second.block_table == second_table  # the other request is untouched
    assert_free_list_invariant(manager.pool)
    manager.free(second)
    assert manager.num_used_blocks == 0
    assert manager.num_free_blocks == 6
    assert_free_list_invariant(manager.pool)
    manager.free(second)  # freeing an empty table is a no-op
    assert manager.num_free_blocks == 6


def test_freed_blocks_are_reused() -> None:
    manager = BlockManager(num_blocks=3, block_size=4)
    first = make_request("a")
    assert manager.allocate_slots(first, 12)
    blocks = set(first.block_table)
    manager.free(first)
    second = make_request("b")
    assert manager.allocate_slots(second, 12)
    assert set(second.block_table) == blocks
    assert manager.num_free_blocks == 0
