"""The gated delta rule twins: the chunk form equals the per-token recurrence (outputs and final
state, any T, with or without an initial state), a sequence split across calls equals one call,
and both equal transformers' Qwen3-Next reference functions."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.gated_delta_torch import chunk_gated_delta_rule, recurrent_gated_delta_rule

B, H, HV, K, V = 2, 2, 4, 16, 8  # HV = 2 H: grouped value heads, as in Qwen3-Next


def _inputs(seq_len: int, seed: int, dtype: torch.dtype = torch.float64) -> dict:
    """Random q, k, v with decays spread over exp(g) in ~(0.37, 1) and beta over (0, 1), so
    neither forgetting nor the write strength is near-trivial, and a non-zero initial state."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "q": rand(B, seq_len, H, K).to(dtype),
        "k": rand(B, seq_len, H, K).to(dtype),
        "v": rand(B, seq_len, HV, V).to(dtype),
        "g": -torch.rand(B, seq_len, HV, generator=gen, dtype=torch.float64).to(dtype),
        "beta": torch.rand(B, seq_len, HV, generator=gen, dtype=torch.float64).to(dtype),
        "initial_state": rand(B, HV, K, V).to(dtype),
    }


@pytest.mark.parametrize("seq_len", [1, 7, 64, 100, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_equals_recurrent(seq_len: int, chunk_size: int, with_state: bool) -> None:
    args = _inputs(seq_len, seed=seq_len * 10 + chunk_size)
    if not with_state:
        args["initial_state"] = None
    out_r, state_r = recurrent_gated_delta_rule(**args, use_qk_l2norm=True)
    out_c, state_c = chunk_gated_delta_rule(**args, use_qk_l2norm=True, chunk_size=chunk_size)
    assert out_c.shape == (B, seq_len, HV, V) and state_c.shape == (B, HV, K, V)
    assert out_c.dtype == state_c.dtype == torch.float64
    torch.testing.assert_close(out_c, out_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state_c, state_r, rtol=1e-10, atol=1e-10)


def test_chunk_equals_recurrent_without_l2norm_and_custom_scale() -> None:
    # Unnormalised keys make the triangular system far from the identity.
    args = _inputs(50, seed=3)
    out_r, state_r = recurrent_gated_delta_rule(**args, scale=0.1)
    out_c, state_c = chunk_gated_delta_rule(**args, scale=0.1, chunk_size=16)
    torch.testing.assert_close(out_c, out_r, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(state_c, state_r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("form", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
@pytest.mark.parametrize("split", [1, 37, 64, 99])
def test_split_sequence_equals_one_call(form: object, split: int) -> None:
    args = _inputs(100, seed=split)
    whole, whole_state = form(**args, use_qk_l2norm=True)
    first = {name: x[:, :split] for name, x in args.items() if name != "initial_state"}
    second = {name: x[:, split:] for name, x in args.items() if name != "initial_state"}
    out_a, state_a = form(**first, initial_state=args["initial_state"], use_qk_l2norm=True)
    out_b, state_b = form(**second, initial_state=state_a, use_qk_l2norm=True)
    torch.testing.assert_close(torch.cat((out_a, out_b), dim=1), whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state_b, whole_state, rtol=1e-10, atol=1e-10)


def test_decay_and_beta_matter() -> None:
    args = _inputs(40, seed=5)
    out, _ = chunk_gated_delta_rule(**args, use_qk_l2norm=True, chunk_size=16)
    no_decay, _ = chunk_gated_delta_rule(
        **{**args, "g": torch.zeros_like(args["g"])}, use_qk_l2norm=True, chunk_size=16
    )
    full_beta, _ = chunk_gated_delta_rule(
        **{**args, "beta": torch.ones_like(args["beta"])}, use_qk_l2norm=True, chunk_size=16
    )
    assert (out - no_decay).abs().max() > 0.1
    assert (out - full_beta).abs().max() > 0.1


def test_bfloat16_inputs_compute_in_float32() -> None:
    args = _inputs(70, seed=11, dtype=torch.bfloat16)
    out, state = chunk_gated_delta_rule(**args, use_qk_l2norm=True, chunk_size=32)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    exact = {name: x.double() for name, x in args.items()}
    out_r, state_r = recurrent_gated_delta_rule(**exact, use_qk_l2norm=True)
    torch.testing.assert_close(out.double(), out_r, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(state.double(), state_r, rtol=1e-4, atol=1e-4)


def _transformers_reference() -> tuple:
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    return qwen3_next.torch_chunk_gated_delta_rule, qwen3_next.torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seq_len", [1, 100])
def test_equals_transformers(dtype: torch.dtype, seq_len: int) -> None:
    """transformers takes the same [B, T, H, *] layout and state [B, HV, K, V], always scales
    by K ** -0.5 and computes in float32; its chunk form is called with chunk_size=64."""
    reference_chunk, reference_recurrent = _transformers_reference()
    args = _inputs(seq_len, seed=21, dtype=dtype)
    common = {
        "initial_state": args["initial_state"],
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
    }
    fields = (args["q"], args["k"], args["v"], args["g"], args["beta"])
    ref_out, ref_state = reference_chunk(*fields, chunk_size=64, **common)
    ref_rec_out, ref_rec_state = reference_recurrent(*fields, **common)
    for form in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        out, state = form(**args, use_qk_l2norm=True)
        torch.testing.assert_close(out, ref_out.to(dtype), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state, ref_state.to(state.dtype), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out, ref_rec_out.to(dtype), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state, ref_rec_state.to(state.dtype), rtol=1e-4, atol=1e-4)
