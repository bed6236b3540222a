"""The MLA twin: the absorbed (decode) form equals the expanded (prefill) form, alone on random
tensors and through the paged latent cache, for decode rows, verify rows and prefill chunks."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_mla import TorchMLAAttention
from dgpp.kernels.mla_attention_torch import absorbed_attention, expanded_attention, mla_attention

HEADS, NOPE, ROPE, RANK, V = 4, 16, 8, 32, 12
SCALE = (NOPE + ROPE) ** -0.5


def _random(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize(("q_len", "seq_len"), [(1, 1), (1, 37), (3, 20), (9, 9)])
def test_absorbed_equals_expanded(q_len: int, seq_len: int) -> None:
    generator = torch.Generator().manual_seed(q_len * 100 + seq_len)
    q_nope = _random(q_len, HEADS, NOPE, generator=generator)
    q_pe = _random(q_len, HEADS, ROPE, generator=generator)
    latents = _random(seq_len, RANK + ROPE, generator=generator)
    kv_b = _random(HEADS, NOPE + V, RANK, generator=generator)
    expanded = expanded_attention(q_nope, q_pe, latents, kv_b, SCALE)  # [Q, H, V]
    # The same causal mask for the absorbed form: query i sees keys 0 .. seq_len - q_len + i.
    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    mask = (torch.arange(seq_len).unsqueeze(0) <= q_pos)[None, None]  # [1, 1, Q, S]
    absorbed = absorbed_attention(
        q_nope.transpose(0, 1).unsqueeze(0),
        q_pe.transpose(0, 1).unsqueeze(0),
        latents.unsqueeze(0),
        kv_b,
        SCALE,
        mask,
    )[0].transpose(0, 1)
    assert expanded.shape == absorbed.shape == (q_len, HEADS, V)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-10, atol=1e-10)


def _attend(
    rows: list[tuple[int, int, list[int]]],
    num_decodes: int,
    cache: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_b: torch.Tensor,
) -> torch.Tensor:
    layout = BatchLayout(
        tuple(BatchRow(start, count, table) for start, count, table in rows),
        num_decodes,
        block_size=cache.shape[1],
        prefill_softmax_fp32=False,
    )
    metadata = TorchMLAAttention(torch.device("cpu")).prepare(layout)
    return mla_attention(q_nope, q_pe, cache, kv_b, metadata, SCALE)


def test_decode_rows_through_the_cache_equal_prefill_rows() -> None:
    """Rows of different lengths on scattered blocks, one a verify row of three queries: the
    batched absorbed decode equals the expanded prefill of the same queries."""
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks = 4, 16
    cache = _random(num_blocks, block_size, RANK + ROPE, generator=generator)
    kv_b = _random(HEADS, NOPE + V, RANK, generator=generator)
    # (start, queries, block table): 10 tokens, 3 tokens, and 7 + 3 verify queries
    rows = [(9, 1, [5, 2, 11]), (2, 1, [7]), (7, 3, [0, 14, 3])]
    num_tokens = sum(count for _, count, _ in rows)
    q_nope = _random(num_tokens, HEADS, NOPE, generator=generator)
    q_pe = _random(num_tokens, HEADS, ROPE, generator=generator)
    decoded = _attend(rows, len(rows), cache, q_nope, q_pe, kv_b)
    prefilled = _attend(rows, 0, cache, q_nope, q_pe, kv_b)
    torch.testing.assert_close(decoded, prefilled, rtol=1e-10, atol=1e-10)


def test_backend_stores_the_latent_at_the_steps_slots() -> None:
    generator = torch.Generator().manual_seed(1)
    cache = torch.zeros(4, 4, RANK + ROPE, dtype=torch.float64)
    backend = TorchMLAAttention(torch.device("cpu"))
    layout = BatchLayout((BatchRow(2, 3, (3, 1)),), 0, block_size=4, prefill_softmax_fp32=False)
    latent = _random(3, RANK + ROPE, generator=generator)
    kv_b = _random(HEADS, NOPE + V, RANK, generator=generator)
    q_nope = _random(3, HEADS, NOPE, generator=generator)
    q_pe = _random(3, HEADS, ROPE, generator=generator)
    backend.forward(q_nope, q_pe, latent, cache, kv_b, backend.prepare(layout), SCALE)
    # positions 2, 3 in block 3; position 4 in block 1
    torch.testing.assert_close(cache[3, 2:], latent[:2])
    torch.testing.assert_close(cache[1, 0], latent[2])
    assert cache.abs().sum() == latent.abs().sum()
