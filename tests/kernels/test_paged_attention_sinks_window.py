"""Attention sinks and sliding windows in the PyTorch paged attention, through the backend's own
`prepare` and `forward`, against transformers' gpt-oss attention (its eager softmax with sinks,
its sliding-window causal mask) on the dense keys, in float64.

Cached keys a row must not read are poisoned with NaN: a decode row's slots before its window,
a prefill chunk's whole blocks before its window's first block. Reading any of them would turn
the output into NaN, so equality with the reference also proves they are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from transformers.masking_utils import (
    causal_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.kernels.attention_metadata import PagedAttentionMetadata

DIM, BLOCK, NUM_BLOCKS = 8, 4, 96
CPU = torch.device("cpu")
DTYPE = torch.float64


def hf_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sinks: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """transformers' gpt-oss eager attention of query [Q, H, D] (the last Q of S positions) over
    keys/values [S, H_kv, D], under its own causal or sliding-window mask rule; no sinks is a
    sink of -inf (it takes no weight)."""
    q_len, seq_len, num_heads = query.shape[0], keys.shape[0], query.shape[1]
    rule = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    q_idx = torch.arange(seq_len - q_len, seq_len).view(-1, 1)
    kv_idx = torch.arange(seq_len).view(1, -1)
    allowed = rule(0, 0, q_idx, kv_idx)  # [Q, S]
    bias = torch.zeros(q_len, seq_len, dtype=DTYPE).masked_fill(~allowed, float("-inf"))
    if sinks is None:
        sinks = torch.full((num_heads,), float("-inf"), dtype=DTYPE)
    module = SimpleNamespace(
        sinks=sinks, num_key_value_groups=num_heads // keys.shape[1], training=False
    )
    out, _ = eager_attention_forward(
        module,
        query.transpose(0, 1).unsqueeze(0),  # [1, H, Q, D]
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        bias[None, None],
        scaling=DIM**-0.5,
    )
    return out[0]  # [Q, H, D]


@dataclass
class Step:
    """One step of random rows (seq_len, query_len), decode rows first, through the backend."""

    queries: list[torch.Tensor]  # [Q, H, D] per row
    keys: list[torch.Tensor]  # [S, H_kv, D] per row, dense
    values: list[torch.Tensor]
    out: torch.Tensor  # [T, H, D] the backend's output
    metadata: PagedAttentionMetadata


def run_step(
    shapes: list[tuple[int, int]],
    num_decodes: int,
    heads: tuple[int, int],
    sinks: torch.Tensor | None,
    window: int | None,
    seed: int,
    dtype: torch.dtype = DTYPE,
    prefill_fp32: bool = False,
) -> Step:
    """Random float64 rows; the backend runs in `dtype` (with `prefill_fp32`, its prefill
    attention in float32)."""
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, num_kv_heads, DIM, dtype=DTYPE)
    # Scattered tables; block 0 stays out of them (decode padding reads slot 0, masked).
    free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    rows, queries, keys, values = [], [], [], []
    for index, (seq_len, q_len) in enumerate(shapes):
        table = [free.pop() for _ in range(-(-seq_len // BLOCK))]
        rows.append(BatchRow(seq_len - q_len, q_len, table))
        k = torch.randn(seq_len, num_kv_heads, DIM, generator=generator, dtype=DTYPE)
        v = torch.randn(seq_len, num_kv_heads, DIM, generator=generator, dtype=DTYPE)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, num_heads, DIM, generator=generator, dtype=DTYPE))
        cached = seq_len - q_len  # this step's tokens go in through the backend's store
        first = 0 if window is None else max(0, cached - window + 1)  # first key it may read
        if index >= num_decodes:
            first = first // BLOCK * BLOCK  # prefill gathers whole blocks
        for pos in range(cached):
            unread = pos < first
            cache[0, table[pos // BLOCK], pos % BLOCK] = float("nan") if unread else k[pos]
            cache[1, table[pos // BLOCK], pos % BLOCK] = float("nan") if unread else v[pos]
    backend = TorchPagedAttention(CPU)
    metadata = backend.prepare(BatchLayout(tuple(rows), num_decodes, BLOCK, prefill_fp32))
    new_k = torch.cat([k[row.start :] for k, row in zip(keys, rows, strict=True)])
    new_v = torch.cat([v[row.start :] for v, row in zip(values, rows, strict=True)])
    out = backend.forward(
        torch.cat(queries).to(dtype),
        new_k.to(dtype),
        new_v.to(dtype),
        cache.to(dtype),
        metadata,
        DIM**-0.5,
        None if sinks is None else sinks.to(dtype),
        window,
    )
    return Step(queries, keys, values, out, metadata)


def assert_matches_transformers(
    step: Step, sinks: torch.Tensor | None, window: int | None, tolerance: float = 1e-10
) -> None:
    begin = 0
    for row, (q, k, v) in enumerate(zip(step.queries, step.keys, step.values, strict=True)):
        expected = hf_attention(q, k, v, sinks, window)
        got = step.out[begin : begin + q.shape[0]].to(DTYPE)
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance, msg=f"row {row}")
        begin += q.shape[0]


# (seq_len, query_len) per row, and how many leading rows are decode rows.
BATCHES = {
    # Decode rows of varied lengths (shorter and longer than the windows), a chunk that starts
    # mid-prompt, a whole prompt.
    "decode": ([(9, 1), (30, 1), (3, 1), (17, 6), (23, 23)], 3),
    # Verify rows (last token + draft) of varied lengths among plain decode rows.
    "verify": ([(9, 1), (26, 4), (13, 3), (2, 2), (31, 7), (11, 11)], 4),
    "prefill": ([(40, 13), (14, 14), (37, 1)], 0),
}
WINDOWS = [None, 1, 3, 6, 8, 100]  # 100 is longer than every row


@pytest.mark.parametrize("heads", [(6, 2), (4, 1), (3, 3)], ids=lambda h: f"H{h[0]}-KV{h[1]}")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window-{w}")
@pytest.mark.parametrize("has_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_sinks_and_window_match_transformers(
    batch: str, has_sinks: bool, window: int | None, heads: tuple[int, int]
) -> None:
    shapes, num_decodes = BATCHES[batch]
    generator = torch.Generator().manual_seed(len(shapes) * 7 + (window or 0))
    # Sinks of either sign, some large: from negligible weight to most of it.
    sinks = 3 * torch.randn(heads[0], generator=generator, dtype=DTYPE) if has_sinks else None
    step = run_step(shapes, num_decodes, heads, sinks, window, seed=window or 0)
    assert_matches_transformers(step, sinks, window)


@pytest.mark.parametrize("prefill_fp32", [False, True], ids=["model-dtype", "prefill-fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sinks_and_window_in_model_dtypes(dtype: torch.dtype, prefill_fp32: bool) -> None:
    """The fused kernels take the sinks' bias in the compute dtype (float32 prefill included)."""
    shapes, num_decodes = BATCHES["verify"]
    sinks = 3 * torch.randn(6, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    sinks = sinks.to(dtype).to(DTYPE)  # the reference takes the sinks as the model holds them
    step = run_step(shapes, num_decodes, (6, 2), sinks, 6, 2, dtype, prefill_fp32)
    assert step.out.dtype == dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert_matches_transformers(step, sinks, 6, tolerance)


def test_window_covering_every_row_is_full_attention_byte_for_byte() -> None:
    shapes, num_decodes = BATCHES["verify"]
    full = run_step(shapes, num_decodes, (6, 2), None, None, seed=3)
    wide = run_step(shapes, num_decodes, (6, 2), None, max(s for s, _ in shapes), seed=3)
    assert torch.equal(full.out, wide.out)


def test_decode_rows_gather_only_their_window_once_per_step() -> None:
    shapes = [(30, 1), (9, 1), (26, 4), (5, 1)]
    step = run_step(shapes, 4, (6, 2), None, 6, seed=1)
    metadata = step.metadata
    full = metadata.decode_context()
    assert full[0] is metadata.decode_slots and full[0].shape == (4, 30)
    slots, mask = metadata.decode_context(6)
    # At most window + queries - 1 slots per row: row 2's queries at 22..25 read 17..25.
    assert slots.shape == (4, 6 + 4 - 1)
    assert mask is not None and mask.shape == (4, 1, 4, 9)
    assert metadata.decode_context(6)[0] is slots  # built once, reused by later layers
    assert metadata.decode_context(3)[0] is not slots
    assert metadata.decode_context(30)[0] is metadata.decode_slots  # covers every row


def test_prefix_hit_with_sliding_window_equals_a_cold_run() -> None:
    """Blocks are never released for sliding layers, so a request that starts on another's
    cached blocks (its first new query's window reaching into them) attends exactly as if it
    had computed them itself: its remaining prompt chunk, then its decode steps."""
    generator = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, window = 6, 2, 6
    sinks = torch.randn(num_heads, generator=generator, dtype=DTYPE)
    total, hit, steps = 26, 16, 5  # prompt tokens, tokens found cached, decode steps
    keys = torch.randn(total + steps, num_kv_heads, DIM, generator=generator, dtype=DTYPE)
    values = torch.randn_like(keys)
    queries = torch.randn(total + steps, num_heads, DIM, generator=generator, dtype=DTYPE)
    backend = TorchPagedAttention(CPU)

    def run(table: list[int], cache: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
        outs = []
        for start, end in chunks:
            row = BatchRow(start, end - start, table[: -(-end // BLOCK)])
            metadata = backend.prepare(BatchLayout((row,), int(end - start == 1), BLOCK, False))
            outs.append(
                backend.forward(
                    queries[start:end],
                    keys[start:end],
                    values[start:end],
                    cache,
                    metadata,
                    DIM**-0.5,
                    sinks,
                    window,
                )
            )
        return torch.cat(outs)

    decodes = [(pos, pos + 1) for pos in range(total, total + steps)]
    cold_cache = torch.zeros(2, NUM_BLOCKS, BLOCK, num_kv_heads, DIM, dtype=DTYPE)
    cold = run(list(range(1, 12)), cold_cache, [(0, 10), (10, total), *decodes])
    # The earlier request wrote the first `hit` tokens into blocks 20..23; the new one takes
    # those blocks and computes the rest in blocks of its own.
    cache = torch.zeros_like(cold_cache)
    shared = [20, 21, 22, 23]
    run(shared, cache, [(0, hit)])
    warm = run([*shared, 40, 41, 42, 43, 44, 45, 46], cache, [(hit, total), *decodes])
    torch.testing.assert_close(warm, cold[hit:], atol=1e-12, rtol=1e-12)
    expected = torch.cat(
        [
            hf_attention(queries[pos : pos + 1], keys[: pos + 1], values[: pos + 1], sinks, window)
            for pos in range(hit, total + steps)
        ]
    )
    torch.testing.assert_close(warm, expected, atol=1e-10, rtol=1e-10)
