"""Kimi Delta Attention twins (the gated delta rule with a decay per key channel): the chunk form
equals the per-token recurrence at any length and chunk size, a sequence split across calls
equals one call, a per-channel decay differs from its per-head mean, both equal transformers'
Kimi-Linear reference functions, and `select_kimi_delta` picks the twins off CUDA."""

from __future__ import annotations

import pytest
import torch

import dgpp.kernels.gated_delta as gd
from dgpp.kernels.gated_delta_torch import chunk_kimi_delta_rule, recurrent_gated_delta_rule

B, H, HV, K, V = 2, 2, 4, 16, 8


def _inputs(seq_len: int, seed: int, dtype: torch.dtype = torch.float64) -> dict:
    """Per-channel decays exp(g) spread over ~(0.37, 1), beta over (0, 1), a non-zero state."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return {
        "q": rand(B, seq_len, H, K),
        "k": rand(B, seq_len, H, K),
        "v": rand(B, seq_len, HV, V),
        "g": -torch.rand(B, seq_len, HV, K, generator=gen, dtype=torch.float64).to(dtype),
        "beta": torch.rand(B, seq_len, HV, generator=gen, dtype=torch.float64).to(dtype),
        "initial_state": rand(B, HV, K, V),
    }


@pytest.mark.parametrize("seq_len", [1, 7, 64, 100])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_equals_recurrent(seq_len: int, chunk_size: int) -> None:
    args = _inputs(seq_len, seed=seq_len)
    want = recurrent_gated_delta_rule(**args, use_qk_l2norm=True)
    got = chunk_kimi_delta_rule(**args, use_qk_l2norm=True, chunk_size=chunk_size)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_split_sequence_equals_one_call() -> None:
    args = _inputs(90, seed=3)
    whole = chunk_kimi_delta_rule(**args, use_qk_l2norm=True, chunk_size=16)
    first = {name: x[:, :37] if name != "initial_state" else x for name, x in args.items()}
    out, state = chunk_kimi_delta_rule(**first, use_qk_l2norm=True, chunk_size=16)
    rest = {name: x[:, 37:] for name, x in args.items() if name != "initial_state"}
    tail, final = chunk_kimi_delta_rule(**rest, initial_state=state, use_qk_l2norm=True)
    torch.testing.assert_close((torch.cat((out, tail), 1), final), whole, rtol=1e-9, atol=1e-9)


def test_a_decay_per_channel_is_not_its_mean() -> None:
    args = _inputs(20, seed=5)
    mean = {**args, "g": args["g"].mean(-1)}
    out, _ = chunk_kimi_delta_rule(**args)
    flat, _ = recurrent_gated_delta_rule(**mean)
    assert (out - flat).abs().max() > 1e-2


@pytest.mark.parametrize("seq_len", [1, 100])
def test_equals_transformers(seq_len: int) -> None:
    """transformers' Kimi-Linear reference (its PyTorch fallback for fla's kernels) in float32,
    its chunk form at 64 tokens a chunk."""
    from transformers.models.kimi_linear import modeling_kimi_linear as reference

    args = _inputs(seq_len, seed=11, dtype=torch.float32)
    fields = (args["q"], args["k"], args["v"])
    common = {
        "g": args["g"],
        "beta": args["beta"],
        "initial_state": args["initial_state"],
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
    }
    # transformers' reference has no grouped value heads: give it the key heads repeated
    fields = tuple(x.repeat_interleave(HV // H, dim=2) for x in fields[:2]) + fields[2:]
    for ref in (
        reference.chunk_kimi_delta_attention(*fields, **common),
        reference.recurrent_kimi_delta_attention(*fields, **common),
    ):
        for form in (chunk_kimi_delta_rule, recurrent_gated_delta_rule):
            out, state = form(**args, use_qk_l2norm=True)
            torch.testing.assert_close(out, ref[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(state, ref[1], rtol=1e-4, atol=1e-4)


def test_cpu_selects_the_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gd.ENV_VAR, raising=False)
    fns = gd.select_kimi_delta(torch.device("cpu"))
    assert fns.chunk is chunk_kimi_delta_rule and fns.recurrent is recurrent_gated_delta_rule
    monkeypatch.setattr(gd, "fla_available", lambda: True)
    monkeypatch.setattr(gd, "_fla_kda", lambda: object())
    assert gd.select_kimi_delta(torch.device("cuda")) is gd.FLA_KDA_FNS
    monkeypatch.setenv(gd.ENV_VAR, "torch")
    assert gd.select_kimi_delta(torch.device("cuda")) is gd.KDA_TORCH_FNS
