"""RMSNorm, alone or after a residual add: the Triton kernel for CUDA tensors where Triton is
installed, a compiled kernel for float32 on CPUs (`rms_norm_cpu`), its PyTorch twin everywhere
else."""

from __future__ import annotations

import torch

from dgpp.kernels import rms_norm_cpu
from dgpp.kernels.dispatch import RMS_NORM, uses_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if uses_triton(x, RMS_NORM):
        from dgpp.kernels.rms_norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_cpu.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if uses_triton(x, RMS_NORM):
        from dgpp.kernels.rms_norm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return rms_norm_cpu.add_rms_norm(x, residual, weight, eps)
