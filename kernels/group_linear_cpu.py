"""The CPU kernel for linear layers on group-quantized weights (`kernels.group_codes`).

`group_linear_cpu` has the twin's signature and meaning (`kernels.group_linear_torch`:
perm applied to x, W dequantized exactly, `F.linear`) and runs kernels/cpu/group_linear.cpp, built
once per machine into dgpp's cache (`kernels.cpu_build`). The kernel computes every weight as
`dequantize_group` does (bit-equal; for 1-2 rows of int4/uint4/e4m3 it applies each group's scale
to the group's dot product instead), so results differ from the twin by float32 rounding of the
sums only (tests/kernels/test_group_linear_cpu.py: rtol 1e-5).

The kernel reads the packed tensors as they are: float16, bfloat16 or float32 scales, the global
scale (NVFP4; one per weight or one per output row) applied in float32 exactly as
`effective_scales` does. So there is no per-call conversion and no load-time preparation step: the
kernel's conversion (64 rows of scales at a time, F16C) measured as fast as float32 effective
scales prepared in advance
(bench/group_linear.py, the "float32 scales" rows). Where the kernel cannot serve (not built, x not
float32, a group size that is not a multiple of 16, a tensor not on the CPU, another scale dtype),
the twin does; an unbuilt kernel is logged once.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from dgpp.kernels.cpu_build import load_cpu_extension
from dgpp.kernels.group_codes import (
    GroupFormat,
    GroupWeight,
    codebook_values,
    dequantize_group,
)
from dgpp.kernels.group_linear_torch import group_linear_torch

SOURCE = Path(__file__).with_name("cpu") / "group_linear.cpp"
# Below this many rows of x the kernel decodes in registers (decode, small batches; W decoded once
# per 8 rows of x); from it on, it dequantizes tiles for ATen's GEMM (prefill). Measured on the
# default model's shapes (Zen 3, one thread): registers 1.5-2x faster at 8 rows, even at 16.
GEMM_ROWS = 16
SCALE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

log = logging.getLogger(__name__)


@cache
def cpu_extension() -> ModuleType | None:
    """The compiled kernel, built on first use; None (logged once) when it cannot be."""
    return load_cpu_extension(
        SOURCE, "group", "group-quantized CPU kernel", log, "those layers use the PyTorch twin"
    )


@cache
def _empty(dtype: torch.dtype) -> torch.Tensor:
    """The kernel's "none" argument for zero codes and global scales (made on first use)."""
    return torch.empty(0, dtype=dtype)


def _global(weight: GroupWeight, fmt: GroupFormat) -> tuple[torch.Tensor, int]:
    """(global scales, mode) as the kernel takes them: float32, one value or one per output row
    (an empty tensor: none); mode 0 none, 1 divide, 2 multiply (`effective_scales` multiplies
    unless the format says "div")."""
    if weight.global_scale is None:
        return _empty(torch.float32), 0
    values = weight.global_scale.to(torch.float32).reshape(-1).contiguous()
    return values, 1 if fmt.global_mode == "div" else 2


def _servable(weight: GroupWeight, fmt: GroupFormat) -> bool:
    """Whether the kernel reads this weight as stored (else the twin serves it)."""
    return (
        fmt.group_size % 16 == 0
        and weight.codes.device.type == "cpu"
        and weight.scales.dtype in SCALE_DTYPES
    )


def _packed(weight: GroupWeight, fmt: GroupFormat) -> tuple[object, ...]:
    """The kernel's leading arguments: codes, scales, zero codes, code table, bits, group."""
    zeros = _empty(torch.uint8) if weight.zeros is None else weight.zeros.contiguous()
    return (
        weight.codes.contiguous(),
        weight.scales.contiguous(),
        zeros,
        codebook_values(fmt.codebook),
        fmt.bits,
        fmt.group_size,
    )


def group_linear_cpu(x: torch.Tensor, weight: GroupWeight, fmt: GroupFormat) -> torch.Tensor:
    """`F.linear(x[..., perm], W)`, x of any leading shape: the twin's result up to float32
    rounding (float32 x on the CPU), or the twin itself where the kernel cannot serve."""
    ext = cpu_extension()
    if ext is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return group_linear_torch(x, weight, fmt)
    if not _servable(weight, fmt):
        return group_linear_torch(x, weight, fmt)
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    shape = x.shape
    global_scale, global_mode = _global(weight, fmt)
    y = ext.group_linear(
        x.reshape(-1, shape[-1]), *_packed(weight, fmt), global_scale, global_mode, GEMM_ROWS
    )
    return y.reshape(*shape[:-1], weight.codes.shape[0])


def group_dequantize_cpu(weight: GroupWeight, fmt: GroupFormat, cols: int) -> torch.Tensor:
    """float32 [rows, cols], bit-equal to `dequantize_group` (perm reorders x, never W): an
    embedding's rows or a tile, by the kernel where it can, else `dequantize_group` itself."""
    ext = cpu_extension()
    if ext is None or not _servable(weight, fmt):
        return dequantize_group(weight, fmt)
    global_scale, global_mode = _global(weight, fmt)
    return ext.group_dequantize(*_packed(weight, fmt), cols, global_scale, global_mode)
