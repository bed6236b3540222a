"""Linear layers on group-quantized weights (`kernels.group_codes`: int4, FP8, NVFP4, MXFP4).

`select_group_linear` picks the kernel once per device: on CPUs the compiled kernel
(`kernels.group_linear_cpu`); on CUDA an FP8 GEMM (`kernels.fp8_linear`) for per-channel FP8 on
GPUs that have one, else the Triton dequantize-GEMM (`kernels.group_linear_triton`, imported only
there: it needs triton); elsewhere, and for a kernel the start-up self-check switched off
(`kernels.dispatch.fall_back`), the PyTorch twin (`kernels.group_linear_torch`), which every
kernel is tested against. docs/quantization.md has the choice and its figures.
"""

from __future__ import annotations

from dgpp.kernels.dispatch import FP8_SCALED_MM, GROUP_LINEAR, has_triton, kernel_on
from dgpp.kernels.fp8_linear import fp8_linear_scaled_mm, scaled_mm_usable
from dgpp.kernels.group_codes import GroupFormat, GroupWeight
from dgpp.kernels.group_linear_cpu import group_linear_cpu
from dgpp.kernels.group_linear_torch import GroupLinearFn, group_linear_torch


def select_group_linear(weight: GroupWeight, fmt: GroupFormat) -> GroupLinearFn:
    """The kernel a layer uses for its group-quantized weight, on the weight's device."""
    device = weight.codes.device
    if device.type == "cuda":
        if kernel_on(FP8_SCALED_MM) and scaled_mm_usable(weight, fmt, device):
            return fp8_linear_scaled_mm
        if kernel_on(GROUP_LINEAR) and has_triton():
            from dgpp.kernels.group_linear_triton import group_linear_triton  # needs triton

            return group_linear_triton
        return group_linear_torch
    if device.type == "cpu":
        return group_linear_cpu
    return group_linear_torch
