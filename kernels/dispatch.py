"""Which implementation serves a tensor: a Triton kernel for CUDA tensors where Triton is
installed, the PyTorch twin of the same signature everywhere else."""

from __future__ import annotations

import importlib.util
from functools import cache

import torch


@cache
def has_triton() -> bool:
    """Whether Triton is installed."""
    return importlib.util.find_spec("triton") is not None


def uses_triton(x: torch.Tensor) -> bool:
    """Whether `x` goes to the Triton kernel (a CUDA tensor, Triton installed)."""
    return x.is_cuda and has_triton()
