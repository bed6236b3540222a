"""Gated activation for fused gate/up projections."""

from __future__ import annotations

import torch
from torch import nn

from dgpp.kernels.activation import silu_and_mul


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is the concatenation [gate | up] on the last dimension
    (`kernels.activation`: Triton on CUDA, the PyTorch twin elsewhere)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
