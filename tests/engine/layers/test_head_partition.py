"""Attention heads dealt to tensor-parallel ranks by whole key/value groups."""

from __future__ import annotations

import pytest

from dgpp.engine.layers.head_partition import HeadPartition, partition_heads


def _all(num_heads: int, num_kv: int, tp_size: int) -> list[HeadPartition]:
    return [partition_heads(num_heads, num_kv, tp_size, rank) for rank in range(tp_size)]


@pytest.mark.parametrize(
    ("num_heads", "num_kv", "tp_size"),
    [(9, 3, 2), (9, 3, 3), (8, 8, 4), (32, 8, 4), (6, 3, 2), (4, 1, 2), (8, 2, 4), (12, 2, 4)],
)
def test_every_query_head_is_held_once_with_its_key_value_head(
    num_heads: int, num_kv: int, tp_size: int
) -> None:
    parts = _all(num_heads, num_kv, tp_size)
    held = [q for p in parts for q in range(p.q_start, p.q_start + p.num_q)]
    assert held == list(range(num_heads))
    group = num_heads // num_kv
    for part in parts:
        assert part.num_q >= 1 and part.num_kv >= 1
        for q in range(part.q_start, part.q_start + part.num_q):
            assert part.kv_start <= q // group < part.kv_start + part.num_kv


def test_smollm2_on_two_ranks_splits_six_and_three() -> None:
    assert _all(9, 3, 2) == [HeadPartition(0, 6, 0, 2), HeadPartition(6, 3, 2, 1)]


def test_even_splits_keep_the_classic_layout() -> None:
    assert _all(32, 8, 4)[1] == HeadPartition(8, 8, 2, 2)
    assert _all(4, 1, 2) == [HeadPartition(0, 2, 0, 1), HeadPartition(2, 2, 0, 1)]


@pytest.mark.parametrize(
    ("num_heads", "num_kv", "tp_size", "message"),
    [
        (4, 4, 8, "exceeds num_attention_heads"),
        (8, 3, 2, "not a multiple"),
        (6, 2, 3, "not a multiple of num_kv_heads"),
        (2, 1, 4, "exceeds"),
    ],
)
def test_impossible_partitions_are_refused(
    num_heads: int, num_kv: int, tp_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        partition_heads(num_heads, num_kv, tp_size, 0)
