"""Linear layers on GGML-block weights (GGUF's Q4_0, Q4_1, Q8_0, ...), kept packed in memory.

`ggml_linear_torch` is the PyTorch twin of every kernel here: dequantize (bit-exact,
`kernels.ggml_blocks`) and `F.linear`. On CPUs `ggml_linear_cpu` runs a small compiled
kernel (kernels/cpu/ggml_linear.cpp, built once per machine with the system C++ compiler into
dgpp's cache) that decodes each block in registers instead of expanding the weight; where it
cannot be built, layers fall back to the twin and say so once. Choice and figures:
docs/quantization.md.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from dgpp.kernels.cpu_build import load_cpu_extension
from dgpp.kernels.ggml_blocks import FORMATS, dequantize

SOURCE = Path(__file__).with_name("cpu") / "ggml_linear.cpp"
CPU_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0"})  # what the compiled kernel decodes
# Below the build's `tile_rows()` rows of x (8 with AVX-512, 16 with AVX2 alone) the kernel decodes
# blocks in registers, each once per 8 rows (decode: memory-bound, the weights streamed once);
# from there to GEMM_ROWS it decodes 4 output rows at a time into an L1 tile for a
# register-blocked GEMM (chunked prefill, batched decode: compute-bound); from GEMM_ROWS on, it
# dequantizes tiles for ATen's GEMM (prefill). Measured: bench/ggml_linear.py, docs/benchmarks.md.
GEMM_ROWS = 128

log = logging.getLogger(__name__)


def ggml_linear_torch(
    x: torch.Tensor, raw: torch.Tensor, fmt: str, in_features: int
) -> torch.Tensor:
    """The twin: `F.linear(x, W)` with W dequantized from its raw rows [out, bytes]."""
    weight = dequantize(raw, FORMATS[fmt], (raw.shape[0], in_features))
    return F.linear(x, weight.to(x.dtype))


@cache
def cpu_extension() -> ModuleType | None:
    """The compiled CPU kernel, built on first use; None (logged once) when it cannot be."""
    return load_cpu_extension(
        SOURCE, "ggml", "GGML CPU kernel", log, "quantized layers use the PyTorch twin"
    )


def ggml_linear_cpu(x: torch.Tensor, raw: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """The CPU kernel: same result as the twin up to float32 summation order."""
    ext = cpu_extension()
    if ext is None or fmt not in CPU_FORMATS or x.dtype != torch.float32:
        return ggml_linear_torch(x, raw, fmt, in_features)
    shape = x.shape
    y = ext.ggml_linear(
        x.reshape(-1, shape[-1]), raw, FORMATS[fmt].ggml_type, _tile_rows(), GEMM_ROWS
    )
    return y.reshape(*shape[:-1], raw.shape[0])


@cache
def _tile_rows() -> int:
    """The build's first tile-path row count, asked once (every linear call passes it)."""
    ext = cpu_extension()
    assert ext is not None
    return int(ext.tile_rows())


def ggml_rows_cpu(raw: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """Dequantized rows (an embedding lookup's), by the kernel where it can, else the twin."""
    ext = cpu_extension()
    if ext is None or fmt not in CPU_FORMATS:
        return dequantize(raw, FORMATS[fmt], (raw.shape[0], in_features))
    return ext.ggml_dequantize(raw, FORMATS[fmt].ggml_type, in_features)
