"""Qwen4-Exp's query-sparse attention twin (`kernels.qsa_torch`), in float64 on scattered paged
blocks with decode, verify and prefill rows together: the block selection equals a brute force
over each query's complete blocks (plus its tail), attention over the selected tokens equals
dense attention masked to them, and selecting everything is dense paged attention."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.kernels.paged_attention_torch import paged_attention
from dgpp.kernels.qsa_torch import select_blocks, selection_width, sparse_paged_attention

HEADS, KV_HEADS, DIM, INDEX_HEADS, INDEX_DIM = 4, 2, 8, 6, 8
BLOCK, RATIO = 4, 3
ROWS = [
    (30, 1, [5, 2, 11, 9, 1, 13, 3, 8]),  # decode at 30
    (17, 3, [0, 14, 6, 10, 12]),  # verify row at 17..19
    (21, 9, [4, 15, 17, 18, 19, 20, 21, 22]),  # prefill chunk at 21..29
    (0, 5, [7, 16]),  # a short prompt
]


def _random(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def _metadata() -> object:
    layout = BatchLayout(
        tuple(BatchRow(start, count, table) for start, count, table in ROWS), 2, BLOCK, False
    )
    return TorchPagedAttention(torch.device("cpu")).prepare(layout)


def _tokens() -> list[tuple[int, list[int]]]:
    return [(start + i, table) for start, count, table in ROWS for i in range(count)]


def _slot(table: list[int], position: int) -> int:
    return table[position // BLOCK] * BLOCK + position % BLOCK


def _pool(keys: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """A stand-in for the model's norm and rope of pooled keys: any function of both."""
    return keys * (1.0 + 0.1 * first.unsqueeze(1))


@pytest.mark.parametrize("budget", [6, 9])
def test_selection_equals_a_brute_force(budget: int) -> None:
    generator = torch.Generator().manual_seed(budget)
    raw = _random(24, BLOCK, INDEX_DIM, generator=generator)
    q = _random(sum(c for _, c, _ in ROWS), INDEX_HEADS, INDEX_DIM, generator=generator)
    selection = select_blocks(q, raw, _metadata(), budget, RATIO, _pool)
    assert selection.positions.shape[1] == selection_width(budget, RATIO)
    flat = raw.view(-1, INDEX_DIM)
    for token, (position, table) in enumerate(_tokens()):
        blocks = (position + 1) // RATIO
        scores = []
        for b in range(blocks):
            keys = torch.stack([flat[_slot(table, b * RATIO + j)] for j in range(RATIO)])
            key = _pool(keys.mean(0, keepdim=True), torch.tensor([b * RATIO]))[0]
            scores.append(float((q[token] @ key).clamp_min(0).sum()))
        kept = sorted(range(blocks), key=lambda b: -scores[b])[: budget // RATIO]
        expected = {b * RATIO + j for b in kept for j in range(RATIO)}
        expected |= set(range(blocks * RATIO, position + 1))
        got = selection.positions[token][selection.valid[token]].tolist()
        assert sorted(got) == sorted(expected), f"token {token} at {position}"
        assert selection.slots[token][selection.valid[token]].tolist() == [
            _slot(table, p) for p in got
        ]


def _attention_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """Raw indexer keys, paged keys and values, indexer queries and attention queries."""
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(c for _, c, _ in ROWS)
    return (
        _random(24, BLOCK, INDEX_DIM, generator=generator),
        _random(24, BLOCK, KV_HEADS, DIM, generator=generator),
        _random(24, BLOCK, KV_HEADS, DIM, generator=generator),
        _random(tokens, INDEX_HEADS, INDEX_DIM, generator=generator),
        _random(tokens, HEADS, DIM, generator=generator),
    )


def test_attention_reads_only_the_selected_tokens() -> None:
    raw, keys, values, q, query = _attention_inputs(1)
    selection = select_blocks(q, raw, _metadata(), 6, RATIO, _pool)
    got = sparse_paged_attention(query, keys, values, selection, 0.3)
    flat_k, flat_v = keys.view(-1, KV_HEADS, DIM), values.view(-1, KV_HEADS, DIM)
    for token, (_, table) in enumerate(_tokens()):
        chosen = selection.positions[token][selection.valid[token]].tolist()
        slots = [_slot(table, p) for p in chosen]
        k = flat_k[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [S, H, D]
        v = flat_v[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)
        weights = (torch.einsum("hd,shd->hs", query[token], k) * 0.3).softmax(-1)
        expected = torch.einsum("hs,shd->hd", weights, v)
        torch.testing.assert_close(got[token], expected, rtol=1e-10, atol=1e-10)


def test_selecting_everything_is_dense_attention() -> None:
    """A budget no row exceeds keeps every token without scoring: dense paged attention."""
    raw, keys, values, q, query = _attention_inputs(2)
    metadata = _metadata()
    selection = select_blocks(q, raw, metadata, 33, RATIO, _pool)
    for token, (position, _) in enumerate(_tokens()):
        assert selection.valid[token].sum() == position + 1
    got = sparse_paged_attention(query, keys, values, selection, 0.3)
    dense = paged_attention(query, keys, values, metadata, 0.3)
    torch.testing.assert_close(got, dense, rtol=1e-10, atol=1e-10)
