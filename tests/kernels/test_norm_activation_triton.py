"""The Triton RMSNorm and SiLU-and-mul kernels against their twins (`kernels.rms_norm_torch`,
`kernels.activation_torch`) under the Triton
interpreter on CPU: alone and fused with the residual add, rows of widths that are and are not
powers of two, float32, float16 and bfloat16; NaN-poisoned outputs are checked through the
kernel's own allocation being fully written (no NaN in any output). The layer's fused residual
path is checked against the unfused one on CPU (bit for bit: the same operations)."""

from __future__ import annotations

# First: sets TRITON_INTERPRET before anything imports triton.
from tests.kernels.triton_interpret import (
    IN_PROCESS,
    interpreted,
    needs_interpreter,
    run_in_a_fresh_interpreter,
)

# isort: split
import pytest
import torch

import dgpp.kernels.activation_triton as act
import dgpp.kernels.rms_norm_triton as rnt
from dgpp.engine.layers.norm import RMSNorm, ZeroCentredRMSNorm
from dgpp.kernels.activation_torch import silu_and_mul
from dgpp.kernels.rms_norm_torch import add_rms_norm, rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# bfloat16: the interpreter truncates each float32 -> bfloat16 cast (a GPU rounds to nearest).
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _interpreted_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted(rnt, "_rms_norm_kernel", monkeypatch)
    interpreted(act, "_silu_and_mul_kernel", monkeypatch)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def inputs(width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(5, width, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    return x, residual, weight


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("width", [64, 96])
def test_kernels_equal_their_twins(width: int, dtype: torch.dtype) -> None:
    x, residual, weight = inputs(width, dtype, seed=width)
    expected = rms_norm(x, weight, 1e-6)
    got = rnt.rms_norm_triton(x, weight, 1e-6)
    assert got.dtype == dtype and not got.isnan().any()
    assert relative_error(got, expected) < TOLERANCE[dtype]
    normed, summed = rnt.add_rms_norm_triton(x, residual, weight, 1e-6)
    expected_normed, expected_summed = add_rms_norm(x, residual, weight, 1e-6)
    # One rounding each; the interpreter's float32 -> bfloat16 cast truncates where a GPU rounds
    # to nearest: one unit in the last place apart at most.
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(summed, expected_summed, rtol=ulp, atol=0)
    assert relative_error(normed, expected_normed) < TOLERANCE[dtype]
    if dtype == torch.float32:  # against float64 too: the twin is no looser than the kernel
        reference = rms_norm(x.double(), weight.double(), 1e-6)
        assert relative_error(got, reference) < TOLERANCE[dtype]


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("width", [48, 1500])  # 1500: two column blocks, the second partial
def test_silu_and_mul_equals_its_twin(width: int, dtype: torch.dtype) -> None:
    x = (torch.randn(3, 2, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(dtype)
    got = act.silu_and_mul_triton(x)
    assert got.shape == (3, 2, width) and got.dtype == dtype and not got.isnan().any()
    reference = silu_and_mul(x.double())
    assert relative_error(got, reference) < TOLERANCE[dtype]
    assert relative_error(silu_and_mul(x), reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("norm_class", [RMSNorm, ZeroCentredRMSNorm])
def test_the_fused_residual_path_equals_add_then_norm(norm_class: type) -> None:
    x, residual, _ = inputs(48, torch.float32, seed=1)
    norm = norm_class(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 48))
    normed, summed = norm.add_forward(x, residual)
    torch.testing.assert_close(summed, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(normed, norm(residual + x), rtol=0, atol=0)


if not IN_PROCESS:

    def test_in_a_fresh_interpreter() -> None:
        run_in_a_fresh_interpreter(__file__)
