"""The compiled GGML CPU kernel equals its PyTorch twin (dequantize + F.linear) on every format
it decodes, on each of its three paths (blocks decoded in registers below `tile_rows()` rows, 8
or 16; the register-blocked tile GEMM up to GEMM_ROWS; ATen's GEMM on dequantized tiles from
there), with row and output counts that leave every tile's tails; its row dequantizer is
bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from dgpp.kernels.ggml_blocks import FORMATS, dequantize
from dgpp.kernels.ggml_linear import (
    CPU_FORMATS,
    GEMM_ROWS,
    cpu_extension,
    ggml_linear_cpu,
    ggml_linear_torch,
    ggml_rows_cpu,
)


@pytest.fixture(scope="module")
def extension() -> object:
    ext = cpu_extension()
    if ext is None:
        pytest.fail("the GGML CPU kernel did not build (a C++ compiler and ninja are needed)")
    return ext


def _raw(fmt: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    return torch.from_numpy(quants.quantize(values, GGMLQuantizationType[fmt]))


@pytest.mark.parametrize("fmt", sorted(CPU_FORMATS))
@pytest.mark.parametrize(
    "rows", [1, 3, 7, 8, 9, 13, 15, 16, 17, 29, GEMM_ROWS - 1, GEMM_ROWS, GEMM_ROWS + 9]
)
@pytest.mark.parametrize("out_features", [72, 69])
def test_kernel_equals_its_twin(extension: object, fmt: str, rows: int, out_features: int) -> None:
    in_features = 160
    raw = _raw(fmt, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    expected = ggml_linear_torch(x, raw, fmt, in_features)
    got = ggml_linear_cpu(x, raw, fmt, in_features)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Leading dimensions are kept.
    batched = ggml_linear_cpu(x.reshape(1, rows, in_features), raw, fmt, in_features)
    torch.testing.assert_close(batched.reshape(rows, out_features), got, rtol=0, atol=0)
    # Each path of the compiled entry point itself: registers, tile GEMM, ATen's GEMM.
    code = FORMATS[fmt].ggml_type
    for tile_rows, gemm_rows in ((10**6, 10**6), (0, 10**6), (0, 0)):
        direct = extension.ggml_linear(x, raw, code, tile_rows, gemm_rows)  # type: ignore[attr-defined]
        torch.testing.assert_close(direct, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", sorted(CPU_FORMATS))
def test_row_dequantizer_is_bit_exact(extension: object, fmt: str) -> None:
    raw = _raw(fmt, 9, 96, seed=3)
    expected = dequantize(raw, FORMATS[fmt], (9, 96))
    got = ggml_rows_cpu(raw, fmt, 96)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_other_formats_and_dtypes_take_the_twin() -> None:
    raw = _raw("Q5_1", 8, 64, seed=1)  # the kernel does not decode Q5_1
    x = torch.randn(2, 64)
    torch.testing.assert_close(
        ggml_linear_cpu(x, raw, "Q5_1", 64), ggml_linear_torch(x, raw, "Q5_1", 64)
    )
    raw = _raw("Q4_1", 8, 64, seed=2)
    xb = x.to(torch.bfloat16)
    assert ggml_linear_cpu(xb, raw, "Q4_1", 64).dtype == torch.bfloat16


def test_bad_shapes_are_refused(extension: object) -> None:
    raw = _raw("Q4_0", 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="does not hold K = 96"):
        extension.ggml_linear(torch.randn(1, 96), raw, FORMATS["Q4_0"].ggml_type, 8, GEMM_ROWS)
