"""Triton SiLU-and-mul: silu(gate) * up for x = [gate | up], one pass over x. Same signature as
the twin `activation_torch.silu_and_mul`; computed in float32 and rounded once (the twin rounds
silu(gate) to x's dtype before the product: they agree within a unit in the last place)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_x: int,
    stride_o: int,
    N: int,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=inside, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * width)
    assert rows.stride(-1) == 1, "rows are contiguous"
    out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(width, block))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), width, BLOCK=block)
    return out.view(*x.shape[:-1], width)
