"""The FP8 GEMM path (`torch._scaled_mm`, which the CPU build of PyTorch has too) against its
twin, and against the weight-only twin within FP8 activation error."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels import fp8_linear
from dgpp.kernels.fp8_linear import (
    fp8_linear_scaled_mm,
    fp8_linear_torch,
    quantize_rows,
    rowwise_scaled_mm_works,
    scaled_mm_usable,
)
from dgpp.kernels.group_codes import GroupFormat, GroupWeight
from dgpp.kernels.group_linear import select_group_linear
from dgpp.kernels.group_linear_torch import group_linear_torch


def _weight(rows: int, cols: int, seed: int = 0) -> tuple[GroupWeight, GroupFormat]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    scales = w.abs().amax(-1, keepdim=True) / 448
    codes = (w / scales).to(torch.float8_e4m3fn).view(torch.uint8)
    return GroupWeight(codes, scales), GroupFormat("e4m3", cols)


@pytest.mark.parametrize("shape", [(1, 96), (5, 96), (2, 3, 96)])
def test_scaled_mm_equals_its_twin(shape: tuple[int, ...]) -> None:
    weight, fmt = _weight(40, 96)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    assert scaled_mm_usable(weight, fmt, torch.device("cpu"))
    got = fp8_linear_scaled_mm(x, weight, fmt)
    twin = fp8_linear_torch(x, weight, fmt)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5 * twin.abs().max().item())
    # against the exact weight-only product: e4m3 activations carry ~2^-4 relative error
    exact = group_linear_torch(x, weight, fmt)
    error = (got - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.08


def test_activation_quantization_round_trips_within_e4m3_precision() -> None:
    x = torch.randn(7, 64) * torch.logspace(-3, 3, 7).unsqueeze(1)
    x[3] = 0.0  # an all-zero row keeps a finite scale
    codes, scales = quantize_rows(x)
    back = codes.float() * scales
    assert torch.isfinite(back).all() and torch.equal(back[3], torch.zeros(64))
    assert ((back - x).abs() <= x.abs() * 2**-3 + 1e-30).all()


def test_only_per_row_e4m3_takes_the_fp8_gemm() -> None:
    weight, fmt = _weight(40, 96)
    cpu = torch.device("cpu")
    block = GroupWeight(weight.codes, weight.scales.expand(40, 3).contiguous())
    assert not scaled_mm_usable(block, GroupFormat("e4m3", 32), cpu)
    assert not scaled_mm_usable(weight._replace(perm=torch.arange(96)), fmt, cpu)
    assert not scaled_mm_usable(weight, GroupFormat("int4", 96), cpu)
    # CPU layers keep the exact weight-only kernel; the FP8 GEMM is for GPUs
    assert select_group_linear(weight, fmt).__name__ == "group_linear_cpu"


def test_gpus_without_per_row_scaled_mm_keep_the_triton_gemm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried once per device: a build whose `_scaled_mm` refuses per-row scales (sm_120/121 in
    some) makes the FP8 layers keep the Triton dequantize-GEMM."""
    cpu = torch.device("cpu")
    rowwise_scaled_mm_works.cache_clear()
    assert rowwise_scaled_mm_works(cpu)  # the CPU build multiplies with per-row scales

    def refuses(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(torch, "_scaled_mm", refuses)
    rowwise_scaled_mm_works.cache_clear()
    try:
        assert not rowwise_scaled_mm_works(cpu)
    finally:
        rowwise_scaled_mm_works.cache_clear()


@pytest.mark.parametrize("works", [True, False])
def test_a_cuda_layer_asks_whether_per_row_scaled_mm_works(
    monkeypatch: pytest.MonkeyPatch, works: bool
) -> None:
    weight, fmt = _weight(40, 96)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 1))
    monkeypatch.setattr(fp8_linear, "rowwise_scaled_mm_works", lambda device: works)
    assert scaled_mm_usable(weight, fmt, torch.device("cuda")) is works
