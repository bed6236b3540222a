"""One packed form for group-quantized weights: int4 (GPTQ, AWQ, compressed-tensors), FP8 e4m3
(block-, channel- or tensor-scaled), NVFP4 and MXFP4 (e2m1).

A weight [rows, cols] is held as `codes` (uint8; two 4-bit codes per byte, the even column in
the low nibble, or one 8-bit code per byte) and one scale per row and group of `group_size`
consecutive columns. A code stands for a value from its codebook; asymmetric int4 subtracts a
per-group zero code; NVFP4 divides (compressed-tensors) or multiplies (ModelOpt) every scale by
one global scale; GPTQ `desc_act` checkpoints keep their columns sorted by group (`perm`: the
layer reads `x[..., perm]`). Dequantized, in float32:

    w[r, c] = (codebook[code[r, c]] - zero[r, c // G]) * (scale[r, c // G]  (/|*) global)

Each checkpoint format converts its own tensors to this form exactly at load
(`quant.checkpoint_formats`); the kernels (`kernels.group_linear`) read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal, NamedTuple

import torch

Codebook = Literal["int4", "uint4", "e2m1", "e4m3"]
GlobalMode = Literal["div", "mul"]
CODE_BITS: dict[str, int] = {"int4": 4, "uint4": 4, "e2m1": 4, "e4m3": 8}
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@cache
def codebook_values(codebook: Codebook) -> torch.Tensor:
    """The float32 value of every code: [16] for 4-bit codebooks, [256] for e4m3."""
    if codebook == "int4":
        return torch.arange(-8, 8, dtype=torch.float32)
    if codebook == "uint4":
        return torch.arange(16, dtype=torch.float32)
    if codebook == "e2m1":
        return torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float32)
    if codebook == "e4m3":
        return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    raise ValueError(f"unknown codebook {codebook!r}")


@dataclass(frozen=True)
class GroupFormat:
    """What the tensors of a `GroupWeight` mean (static per layer)."""

    codebook: Codebook
    group_size: int  # columns per scale
    global_mode: GlobalMode | None = None  # how `global_scale` applies to every scale
    scale_dtype: str = "float32"  # float16 | bfloat16 | float32: the checkpoint's, kept exact
    zeros: bool = False  # per-group zero codes (asymmetric int4)
    act_order: bool = False  # columns sorted by group: the layer reads x[..., perm]

    @property
    def bits(self) -> int:
        return CODE_BITS[self.codebook]

    def code_bytes(self, cols: int) -> int:
        return cols * self.bits // 8

    def describe(self) -> str:
        return f"{self.codebook} g{self.group_size}"


class GroupWeight(NamedTuple):
    """The tensors of one packed weight [rows, cols]."""

    codes: torch.Tensor  # uint8 [rows, cols * bits / 8]
    scales: torch.Tensor  # float16 | bfloat16 | float32 [rows, cols / group_size]
    zeros: torch.Tensor | None = None  # uint8 [rows, cols / group_size], zero codes (uint4)
    global_scale: torch.Tensor | None = None  # float32 [rows] or []: per output row (NVFP4)
    perm: torch.Tensor | None = None  # int64 [cols]: the layer's input is x[..., perm]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes 0..15 -> [rows, cols / 2] bytes, even columns in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_nibbles` for 4-bit codes; 8-bit codes as they are. int64 indices."""
    if bits == 8:
        return codes.to(torch.int64)
    low, high = codes & 0x0F, codes >> 4
    return torch.stack([low, high], dim=-1).flatten(-2).to(torch.int64)


def effective_scales(weight: GroupWeight, fmt: GroupFormat) -> torch.Tensor:
    """float32 [rows, groups]: each group's scale with the global scale applied."""
    scales = weight.scales.to(torch.float32)
    if weight.global_scale is None:
        return scales
    global_scale = weight.global_scale.to(torch.float32).reshape(-1, 1)  # [rows | 1, 1]
    return scales / global_scale if fmt.global_mode == "div" else scales * global_scale


def dequantize_group(weight: GroupWeight, fmt: GroupFormat) -> torch.Tensor:
    """float32 [rows, cols] in the layer's column order (`perm` applied, as the kernels read)."""
    values = codebook_values(fmt.codebook)[unpack_codes(weight.codes, fmt.bits)]
    rows, cols = values.shape
    grouped = values.view(rows, cols // fmt.group_size, fmt.group_size)
    if weight.zeros is not None:
        grouped = grouped - weight.zeros.to(torch.float32).unsqueeze(-1)
    return (grouped * effective_scales(weight, fmt).unsqueeze(-1)).view(rows, cols)


def group_bytes(fmt: GroupFormat, rows: int, cols: int, scale_bytes: int, zeros: bool) -> int:
    """Bytes of a packed [rows, cols] weight (codes, scales, zero codes)."""
    groups = rows * (cols // fmt.group_size)
    return rows * fmt.code_bytes(cols) + groups * (scale_bytes + (1 if zeros else 0))
