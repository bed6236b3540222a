"""Linear layers on group-quantized weights (`engine.quant.group_codes`: int4, FP8, NVFP4, MXFP4).

`group_linear_torch` is the PyTorch twin of every kernel here: dequantize (exactly,
`dequantize_group`) and `F.linear`. `select_group_linear` picks the kernel once per device: on
CPUs the compiled kernel (`kernels.group_linear_cpu`); on CUDA an FP8 GEMM (`kernels.fp8_linear`)
for per-channel FP8 on GPUs that have one, else the Triton dequantize-GEMM
(`kernels.group_linear_triton`); docs/quantization.md has the choice and its figures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dgpp.engine.quant.group_codes import GroupFormat, GroupWeight, dequantize_group

GroupLinearFn = Callable[[torch.Tensor, GroupWeight, GroupFormat], torch.Tensor]


def group_linear_torch(x: torch.Tensor, weight: GroupWeight, fmt: GroupFormat) -> torch.Tensor:
    """The twin: `F.linear(x[..., perm], W)` with W dequantized from its codes."""
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    return F.linear(x, dequantize_group(weight, fmt).to(x.dtype))


def select_group_linear(weight: GroupWeight, fmt: GroupFormat) -> GroupLinearFn:
    """The kernel a layer uses for its group-quantized weight, on the weight's device."""
    device = weight.codes.device
    if device.type == "cuda":
        from dgpp.kernels.fp8_linear import fp8_linear_scaled_mm, scaled_mm_usable

        if scaled_mm_usable(weight, fmt, device):
            return fp8_linear_scaled_mm
        from dgpp.kernels.group_linear_triton import group_linear_triton  # needs triton

        return group_linear_triton
    if device.type == "cpu":
        from dgpp.kernels.group_linear_cpu import group_linear_cpu  # imports this module

        return group_linear_cpu
    return group_linear_torch
