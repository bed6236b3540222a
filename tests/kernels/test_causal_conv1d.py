"""The causal conv twin: one prefill call equals pieces carrying conv_state equals token-by-token
decode, and equals transformers' Qwen3-Next fallback (full-sequence and cached-update paths)."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.causal_conv1d_torch import causal_conv1d

B, T, D, W = 2, 23, 12, 4


def _inputs(seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(D, W, generator=gen, dtype=torch.float64).to(dtype)
    bias = torch.randn(D, generator=gen, dtype=torch.float64).to(dtype)
    return x, weight, bias


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_pieces_and_decode_equal_one_call(with_bias: bool, activation: str | None) -> None:
    x, weight, bias = _inputs(seed=1)
    bias = bias if with_bias else None
    whole, whole_state = causal_conv1d(x, weight, bias, activation=activation)
    assert whole.shape == (B, T, D) and whole_state.shape == (B, W - 1, D)
    torch.testing.assert_close(whole_state, x[:, -(W - 1) :])

    # Pieces shorter and longer than the state, so the state is partly carried over.
    pieces, state = [], None
    for start, end in [(0, 2), (2, 3), (3, 11), (11, T)]:
        y, state = causal_conv1d(x[:, start:end], weight, bias, state, activation)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, whole_state)

    steps, state = [], None
    for t in range(T):
        y, state = causal_conv1d(x[:, t : t + 1], weight, bias, state, activation)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, whole_state)


def test_bfloat16_keeps_dtype() -> None:
    x, weight, bias = _inputs(seed=2, dtype=torch.bfloat16)
    y, state = causal_conv1d(x, weight, bias)
    assert y.dtype == state.dtype == torch.bfloat16
    exact, _ = causal_conv1d(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(y.double(), exact, rtol=2e-2, atol=2e-2)


def test_equals_transformers_fallback() -> None:
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, weight, bias = _inputs(seed=3, dtype=torch.float32)
    prefill, decode_at = 15, 15
    # Full-sequence path: channel-first x [B, D, T], zero history.
    reference = qwen3_next.causal_conv1d_fn(x[:, :prefill].transpose(1, 2), weight, bias, "silu")
    y, state = causal_conv1d(x[:, :prefill], weight, bias, activation="silu")
    torch.testing.assert_close(y, reference.transpose(1, 2), rtol=1e-6, atol=1e-6)

    # Cached decode path: its state is channel-first [B, D, W] (one column more than needed),
    # updated in place.
    ref_state = torch.zeros(B, D, W)
    ref_state[:, :, 1:] = state.transpose(1, 2)
    for t in range(decode_at, T):
        step = x[:, t : t + 1]
        reference = qwen3_next.causal_conv1d_update(
            step.transpose(1, 2), ref_state, weight, bias, "silu"
        )
        y, state = causal_conv1d(step, weight, bias, state, "silu")
        torch.testing.assert_close(y, reference.transpose(1, 2), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state, ref_state[:, :, 1:].transpose(1, 2))
