"""RMSNorm, alone or after a residual add: the Triton kernel for CUDA tensors where Triton is
installed, its PyTorch twin everywhere else."""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

from dgpp.kernels import rms_norm_torch


@cache
def has_triton() -> bool:
    """Whether Triton is installed (its kernels are used for CUDA tensors)."""
    return importlib.util.find_spec("triton") is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and has_triton():
        from dgpp.kernels.rms_norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if x.is_cuda and has_triton():
        from dgpp.kernels.rms_norm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return rms_norm_torch.add_rms_norm(x, residual, weight, eps)
