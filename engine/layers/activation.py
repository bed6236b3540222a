"""Gated activation for fused gate/up projections."""

from __future__ import annotations

import torch
from torch import nn

from dgpp.kernels.activation import silu_and_mul
from dgpp.kernels.fused_moe_torch import moe_activation


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is the concatenation [gate | up] on the last dimension
    (`kernels.activation`: Triton on CUDA, the PyTorch twin elsewhere)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class ClampedSiluAndMul(nn.Module):
    """DeepSeek-V4's SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit) (its shared and
    routed experts alike; `kernels.fused_moe_torch.moe_activation`'s `swiglu_clamp`)."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return moe_activation(x, "swiglu_clamp", limit=self.limit)
