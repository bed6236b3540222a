"""RMSNorm on CPUs: a small compiled kernel (kernels/cpu/rms_norm.cpp) for float32 rows, the
PyTorch twin (`rms_norm_torch`) for every other dtype and where it cannot be built (said once).
Same signatures and results as the twin up to the order of the sum of squares."""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from dgpp.kernels import rms_norm_torch
from dgpp.kernels.cpu_build import load_cpu_extension

SOURCE = Path(__file__).with_name("cpu") / "rms_norm.cpp"

log = logging.getLogger(__name__)


@cache
def cpu_extension() -> ModuleType | None:
    """The compiled kernel, built on first use; None (logged once) when it cannot be."""
    return load_cpu_extension(SOURCE, "norm", "RMSNorm CPU kernel", log, "RMSNorm uses the twin")


def _takes(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return cpu_extension()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension."""
    ext = _takes(x, weight)
    return rms_norm_torch.rms_norm(x, weight, eps) if ext is None else ext.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    ext = _takes(x, weight)
    if ext is None or residual.dtype != torch.float32 or residual.shape != x.shape:
        return rms_norm_torch.add_rms_norm(x, residual, weight, eps)
    return ext.add_rms_norm(x, residual, weight, eps)
