"""Which implementation serves a tensor: a Triton kernel for CUDA tensors where Triton is
installed, the PyTorch twin of the same signature everywhere else."""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch


@cache
def has_triton() -> bool:
    """Whether Triton is installed."""
    return importlib.util.find_spec("triton") is not None


def uses_triton(x: torch.Tensor) -> bool:
    """Whether `x` goes to the Triton kernel (a CUDA tensor, Triton installed)."""
    return x.is_cuda and has_triton()


def float32_products(dtype: torch.dtype) -> bool:
    """Whether a Triton kernel multiplies its `tl.dot` operands in float32 (IEEE): for float32
    tensors (no TF32 rounding, as the twins), and always under Triton's interpreter, whose 16-bit
    `tl.dot` is wrong (Triton 3.9: it multiplies the raw bits)."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
