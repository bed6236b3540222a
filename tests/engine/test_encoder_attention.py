"""The encoder's attention (`backends/encoder.py`) equals each prompt attended alone: prompts of
different lengths padded together under a mask, prompts of one length unmasked, the batch split
into several padded calls where their query-key pairs pass the budget, and a prompt past it
attended alone, unpadded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpp.engine.backends import encoder
from dgpp.engine.backends.base import BatchLayout, BatchRow

CPU = torch.device("cpu")


def _layout(lengths: list[int]) -> BatchLayout:
    rows = tuple(BatchRow(0, n, ()) for n in lengths)
    return BatchLayout(rows, 0, 16, False)


@pytest.mark.parametrize(
    ("lengths", "kinds"),
    [
        ([5, 5, 5], ["even"]),  # one call, no mask
        ([3, 17, 9], ["ragged"]),  # one call, masked
        ([3, 40, 9, 70, 2], ["ragged", "even", "alone", "even"]),  # budget 64^2: split
    ],
)
def test_groups_equal_each_prompt_alone(
    lengths: list[int], kinds: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(encoder, "PAIRS", 64 * 64)
    backend = encoder.EncoderAttentionBackend(CPU)
    rows = backend.prepare(_layout(lengths))
    found = ["alone" if g.rows is None else "ragged" if g.ragged else "even" for g in rows.groups]
    assert found == kinds
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(sum(lengths), 4, 8, generator=gen) for _ in range(3))
    got = backend.forward(q, k, v, rows, 0.3)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        heads = [x[part].transpose(0, 1) for x in (q, k, v)]
        want = F.scaled_dot_product_attention(*heads, scale=0.3).transpose(0, 1)
        assert torch.allclose(got[part], want, atol=1e-6), n
        start += n


def test_a_row_that_does_not_start_a_prompt_is_refused() -> None:
    layout = BatchLayout((BatchRow(4, 3, ()),), 0, 16, False)
    with pytest.raises(RuntimeError, match="computes a prompt whole"):
        encoder.EncoderAttentionBackend(CPU).prepare(layout)
