"""The PyTorch paged-attention twin against dense causal attention computed from scratch."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.decode_inputs import decode_gather_inputs, decode_query_index
from dgpp.kernels.paged_attention_torch import paged_attention, store_kv

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last q_len queries over keys [S, H_kv, D], heads grouped."""
    q_len, seq_len = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * scale
    allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


# (seq_len, query_len) per row, and how many leading rows are decode rows.
BATCHES = {
    # Two decode rows of unequal length, a chunk mid-prompt, a full prompt.
    "decode": ([(9, 1), (22, 1), (17, 6), (11, 11)], 2),
    # Decode rows with speculative verify rows (last token + draft) among them.
    "verify": ([(9, 1), (22, 4), (13, 3), (5, 5), (17, 6), (11, 11)], 4),
    "verify-only": ([(30, 2), (6, 5)], 2),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_mixed_decode_and_prefill_batch_matches_dense_attention(seed: int, batch: str) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 64
    key_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    value_cache = torch.zeros_like(key_cache)
    shapes, num_decodes = BATCHES[batch]
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()  # scattered tables
    tables, full_keys, full_values, queries, slots = [], [], [], [], []
    for seq_len, q_len in shapes:
        table = [free_blocks.pop() for _ in range(-(-seq_len // BLOCK))]
        tables.append(table)
        keys = torch.randn(seq_len, KV_HEADS, DIM, generator=generator)
        values = torch.randn(seq_len, KV_HEADS, DIM, generator=generator)
        full_keys.append(keys)
        full_values.append(values)
        # Context already cached before this step; this step's tokens go in through store_kv.
        cached = seq_len - q_len
        for pos in range(cached):
            key_cache[table[pos // BLOCK], pos % BLOCK] = keys[pos]
            value_cache[table[pos // BLOCK], pos % BLOCK] = values[pos]
        slots.extend(table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, seq_len))
        queries.append(torch.randn(q_len, HEADS, DIM, generator=generator))
    new_keys = torch.cat([k[s - q :] for k, (s, q) in zip(full_keys, shapes, strict=True)])
    new_values = torch.cat([v[s - q :] for v, (s, q) in zip(full_values, shapes, strict=True)])
    slot_mapping = torch.tensor(slots)
    store_kv(new_keys, new_values, key_cache, value_cache, slot_mapping)

    starts = [0]
    for _, q_len in shapes:
        starts.append(starts[-1] + q_len)
    width = max(len(t) for t in tables)
    seq_lens = [s for s, _ in shapes]
    query_lens = [q for _, q in shapes[:num_decodes]]
    cpu = torch.device("cpu")
    decode_slots, decode_mask = decode_gather_inputs(
        tables[:num_decodes], seq_lens[:num_decodes], BLOCK, cpu, query_lens
    )
    query_index = decode_query_index(query_lens, cpu)
    assert (query_index is None) == (max(query_lens) == 1)
    metadata = PagedAttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc_host=tuple(starts),
        seq_lens_host=tuple(seq_lens),
        num_decodes=num_decodes,
        max_seq_len=max(seq_lens),
        prefill_softmax_fp32=True,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        decode_query_index=query_index[0] if query_index else None,
        decode_output_index=query_index[1] if query_index else None,
    )
    scale = DIM**-0.5
    out = paged_attention(torch.cat(queries), key_cache, value_cache, metadata, scale)
    for row, (q, k, v) in enumerate(zip(queries, full_keys, full_values, strict=True)):
        expected = dense_reference(q, k, v, scale)
        torch.testing.assert_close(
            out[starts[row] : starts[row + 1]], expected, atol=1e-5, rtol=1e-5
        )


def test_decode_padding_mask_only_when_lengths_differ() -> None:
    cpu = torch.device("cpu")
    slots, mask = decode_gather_inputs([[3, 5]], [7], BLOCK, cpu)
    assert mask is None
    assert slots.tolist() == [[12, 13, 14, 15, 20, 21, 22]]
    slots, mask = decode_gather_inputs([[3, 5], [1]], [7, 2], BLOCK, cpu)
    assert mask is not None and mask.shape == (2, 1, 1, 7)
    assert mask[1, 0, 0].tolist() == [True, True] + [False] * 5
    assert slots[1, :2].tolist() == [4, 5]


def test_verify_rows_mask_is_causal_within_the_draft() -> None:
    cpu = torch.device("cpu")
    # Row 0: 6 tokens, the last 3 are queries; row 1: a plain decode row of 2 tokens.
    _, mask = decode_gather_inputs([[3, 5], [1]], [6, 2], BLOCK, cpu, [3, 1])
    assert mask is not None and mask.shape == (2, 1, 3, 6)
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1] * 6]
    assert mask[1, 0].int().tolist() == [[1, 1, 0, 0, 0, 0]] * 3  # padding repeats the query
    index = decode_query_index([3, 1], cpu)
    assert index is not None
    assert index[0].tolist() == [[0, 1, 2], [3, 3, 3]]
    assert index[1].tolist() == [0, 1, 2, 3]
    assert decode_query_index([1, 1], cpu) is None


def test_store_kv_writes_only_the_given_slots() -> None:
    key_cache = torch.zeros(4, BLOCK, KV_HEADS, DIM)
    value_cache = torch.zeros_like(key_cache)
    key = torch.ones(2, KV_HEADS, DIM)
    store_kv(key, -key, key_cache, value_cache, torch.tensor([5, 14]))
    flat_k = key_cache.view(-1, KV_HEADS, DIM)
    assert flat_k[5].eq(1).all() and flat_k[14].eq(1).all()
    assert flat_k.abs().sum() == 2 * KV_HEADS * DIM
    assert value_cache.view(-1, KV_HEADS, DIM)[14].eq(-1).all()
