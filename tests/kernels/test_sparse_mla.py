"""The DeepSeek Sparse Attention twin (`kernels.sparse_mla_torch`), in float64 on scattered
paged blocks with decode, verify and prefill rows together: the top-k selection equals a brute
force over each query's context, attention over the selected latents equals attention masked
to them, selecting every position is dense MLA, and tiling changes nothing."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_mla import TorchMLAAttention
from dgpp.kernels import sparse_mla_torch
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.mla_attention_torch import absorbed_attention, mla_attention
from dgpp.kernels.sparse_mla_torch import select_topk, sparse_mla_attention

HEADS, NOPE, ROPE, RANK, V = 4, 16, 8, 32, 12
INDEX_HEADS, INDEX_DIM = 16, 8  # enough heads that no key scores exactly zero (a tie)
SCALE = (NOPE + ROPE) ** -0.5
BLOCK = 4
# (start, queries, block table): a decode row at 30, a verify row of three at 17..19, a
# prefill chunk of 9 at 21..29, and a one-token prefill row at 5.
ROWS = [
    (30, 1, [5, 2, 11, 9, 1, 13, 3, 8]),
    (17, 3, [0, 14, 6, 10, 12]),
    (21, 9, [4, 15, 17, 18, 19, 20, 21, 22]),
    (5, 1, [7, 16]),
]
NUM_DECODES = 2


def _random(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def _metadata(rows: list[tuple[int, int, list[int]]], num_decodes: int) -> PagedAttentionMetadata:
    layout = BatchLayout(
        tuple(BatchRow(start, count, table) for start, count, table in rows),
        num_decodes,
        block_size=BLOCK,
        prefill_softmax_fp32=False,
    )
    return TorchMLAAttention(torch.device("cpu")).prepare(layout)


def _query_rows() -> list[tuple[int, list[int]]]:
    """Each query token's (position, block table), in step order."""
    return [(start + i, table) for start, count, table in ROWS for i in range(count)]


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(count for _, count, _ in ROWS)
    keys = _random(24, BLOCK, INDEX_DIM, generator=generator)
    latents = _random(24, BLOCK, RANK + ROPE, generator=generator)
    q = _random(tokens, INDEX_HEADS, INDEX_DIM, generator=generator)
    weights = _random(tokens, INDEX_HEADS, generator=generator)
    q_nope = _random(tokens, HEADS, NOPE, generator=generator)
    q_pe = _random(tokens, HEADS, ROPE, generator=generator)
    kv_b = _random(HEADS, NOPE + V, RANK, generator=generator)
    return keys, latents, q, weights, q_nope, q_pe, kv_b


def _slot(table: list[int], position: int) -> int:
    return table[position // BLOCK] * BLOCK + position % BLOCK


@pytest.mark.parametrize("topk", [4, 7])
def test_selection_equals_a_brute_force(topk: int) -> None:
    keys, _, q, weights, *_ = _inputs(0)
    selection = select_topk(q, weights, keys, _metadata(ROWS, NUM_DECODES), topk, 0.3)
    flat = keys.view(-1, INDEX_DIM)
    for token, (position, table) in enumerate(_query_rows()):
        scores = []
        for s in range(position + 1):
            k = flat[_slot(table, s)]
            relu = [max(0.0, 0.3 * float(q[token, h] @ k)) for h in range(INDEX_HEADS)]
            scores.append(sum(float(weights[token, h]) * relu[h] for h in range(INDEX_HEADS)))
        valid = selection.valid[token]
        got = selection.positions[token][valid].tolist()
        expected = sorted(range(position + 1), key=lambda s: -scores[s])[:topk]
        assert sorted(got) == sorted(expected), f"token {token} at {position}"
        slots = selection.slots[token][valid].tolist()
        assert slots == [_slot(table, s) for s in got]


def test_attention_reads_only_the_selected_latents() -> None:
    """Each query's output is absorbed attention over its whole context masked to the
    selected positions."""
    keys, latents, q, weights, q_nope, q_pe, kv_b = _inputs(1)
    selection = select_topk(q, weights, keys, _metadata(ROWS, NUM_DECODES), 5, 0.3)
    got = sparse_mla_attention(q_nope, q_pe, latents, kv_b, selection, SCALE)
    flat = latents.view(-1, RANK + ROPE)
    for token, (position, table) in enumerate(_query_rows()):
        context = flat[[_slot(table, s) for s in range(position + 1)]]  # [S, L + R]
        mask = torch.zeros(1, 1, 1, position + 1, dtype=torch.bool)
        chosen = selection.positions[token][selection.valid[token]]
        mask[..., chosen] = True
        one = (q_nope[token, :, None][None], q_pe[token, :, None][None], context[None])
        expected = absorbed_attention(*one, kv_b, SCALE, mask)[0, :, 0]
        torch.testing.assert_close(got[token], expected, rtol=1e-10, atol=1e-10)


def test_selecting_every_position_is_dense_attention() -> None:
    """A budget no row exceeds selects every position (no scoring): the sparse path equals
    dense MLA (absorbed decode, expanded prefill) up to rounding."""
    keys, latents, q, weights, q_nope, q_pe, kv_b = _inputs(2)
    metadata = _metadata(ROWS, NUM_DECODES)
    selection = select_topk(q, weights, keys, metadata, 32, 0.3)
    assert all(
        selection.valid[token].sum() == position + 1
        for token, (position, _) in enumerate(_query_rows())
    )
    got = sparse_mla_attention(q_nope, q_pe, latents, kv_b, selection, SCALE)
    dense = mla_attention(q_nope, q_pe, latents, kv_b, metadata, SCALE)
    torch.testing.assert_close(got, dense, rtol=1e-10, atol=1e-10)


def test_tiles_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny tiles (one query at a time) give the one-tile results exactly."""
    keys, latents, q, weights, q_nope, q_pe, kv_b = _inputs(3)
    metadata = _metadata(ROWS, NUM_DECODES)
    whole = select_topk(q, weights, keys, metadata, 6, 0.3)
    whole_out = sparse_mla_attention(q_nope, q_pe, latents, kv_b, whole, SCALE)
    monkeypatch.setattr(sparse_mla_torch, "TILE_ELEMENTS", 1)
    tiled = select_topk(q, weights, keys, metadata, 6, 0.3)
    assert torch.equal(tiled.positions, whole.positions)
    tiled_out = sparse_mla_attention(q_nope, q_pe, latents, kv_b, tiled, SCALE)
    torch.testing.assert_close(tiled_out, whole_out, rtol=1e-12, atol=1e-12)
