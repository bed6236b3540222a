"""An orthonormal rotation of keys and values before a 4-bit KV cache stores them, as llama.cpp
does for its quantized caches (its "rotate activations for better quantization", on whenever the
head size is a multiple of 64): a few large entries of a rotated key (RoPE concentrates energy
in the low-frequency pairs) set each Q4_0 block's scale and flush the rest to zero; spread by a
Walsh-Hadamard rotation they do not. Measured on the default model (docs/quality.md): int4's KL
against the float cache halves, 0.152 to 0.077.

The rotation R is block-diagonal, one normalized Sylvester-Hadamard block of `BLOCK` (64) per
64 dimensions: symmetric, R R = I, so q R . k R = q . k and the attention's output in the rotated
value space, multiplied by R, is the output. Applied by the attention backend around its store
and attend (`engine.backends.torch_paged`), the kernels read the rows as they are.
"""

from __future__ import annotations

import math
from functools import cache

import torch

BLOCK = 64


@cache
def _hadamard(size: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(size)


@cache
def _rotation(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.block_diag(*[_hadamard(BLOCK)] * (head_dim // BLOCK)).to(device, dtype)


def rotation(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """R [head_dim, head_dim] for heads of `head_dim`; None where it is not a multiple of 64."""
    if head_dim % BLOCK:
        return None
    return _rotation(head_dim, torch.device(device), dtype)


def rotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """x [..., D] R (its own inverse: the same call turns a rotated output back)."""
    return x if r is None else x @ r
