"""The gated activation: the Triton kernel for CUDA tensors where Triton is installed, its
PyTorch twin everywhere else."""

from __future__ import annotations

import torch

from dgpp.kernels import activation_torch
from dgpp.kernels.dispatch import SILU_AND_MUL, uses_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if uses_triton(x, SILU_AND_MUL):
        from dgpp.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return activation_torch.silu_and_mul(x)
