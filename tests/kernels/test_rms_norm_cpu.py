"""The compiled CPU RMSNorm (kernels/cpu/rms_norm.cpp) equals its PyTorch twin on float32 rows of
every shape the layers pass (tokens x hidden, tokens x heads x head dim, one row), strided inputs
included; other dtypes take the twin."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels import rms_norm_cpu, rms_norm_torch


@pytest.fixture(scope="module", autouse=True)
def extension() -> object:
    ext = rms_norm_cpu.cpu_extension()
    if ext is None:
        pytest.fail("the RMSNorm CPU kernel did not build (a C++ compiler and ninja)")
    return ext


@pytest.mark.parametrize("shape", [(1, 576), (7, 960), (300, 64), (5, 9, 64), (576,)])
def test_rms_norm_equals_the_twin(extension: object, shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(*shape, generator=generator) * 3
    weight = torch.randn(shape[-1], generator=generator)
    expected = rms_norm_torch.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(rms_norm_cpu.rms_norm(x, weight, 1e-6), expected)
    # the compiled entry point itself, not only the wrapper that may route to the twin
    torch.testing.assert_close(extension.rms_norm(x, weight, 1e-6), expected)  # type: ignore[attr-defined]
    residual = torch.randn(*shape, generator=generator)
    normed, summed = rms_norm_cpu.add_rms_norm(x, residual, weight, 1e-5)
    twin_normed, twin_summed = rms_norm_torch.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, twin_summed)
    torch.testing.assert_close(normed, twin_normed)


def test_strided_rows_and_a_large_epsilon() -> None:
    x = torch.randn(6, 256)[:, ::2]  # not contiguous
    weight = torch.rand(128)
    torch.testing.assert_close(
        rms_norm_cpu.rms_norm(x, weight, 0.5), rms_norm_torch.rms_norm(x, weight, 0.5)
    )
    zeros = torch.zeros(2, 128)
    assert torch.equal(rms_norm_cpu.rms_norm(zeros, weight, 1e-6), zeros)


def test_other_dtypes_take_the_twin() -> None:
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    weight = torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(
        rms_norm_cpu.rms_norm(x, weight, 1e-6), rms_norm_torch.rms_norm(x, weight, 1e-6)
    )
    normed, summed = rms_norm_cpu.add_rms_norm(x, x, weight, 1e-6)
    assert normed.dtype == summed.dtype == torch.bfloat16
