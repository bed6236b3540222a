"""GGML block formats (the GGUF tensor types): their layouts, and dequantizers in PyTorch.

A quantized GGUF tensor of shape [rows, cols] is stored as rows of `cols / block_size` blocks;
each block holds `block_size` consecutive weights of one row in `type_size` bytes. The
dequantizers here take those raw bytes (uint8, [..., blocks * type_size]) and return float32
values equal, bit for bit, to gguf-py's reference `gguf.quants.dequantize` (the same operations
in the same order, tested in tests/engine/quant/test_ggml_blocks.py). Layouts follow ggml's
`block_q*` structs: every scale is little-endian float16, nibbles are low half first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # GGMLQuantizationType value
    block_size: int  # weights per block
    type_size: int  # bytes per block
    dequantize: Callable[[torch.Tensor], torch.Tensor]  # [n, type_size] uint8 -> [n, block] f32


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from [n, 2] bytes, as float32 ([n, 1])."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k] values: the k low nibbles, then the k high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_values(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _bf16_values(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return d * _nibbles(blocks[:, 4:]).to(torch.float32) + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """The fifth bits of Q5_0/Q5_1: a little-endian uint32, bit j for weight j ([n, 32])."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (qh.unsqueeze(-1) >> shifts) & 1  # [n, 4 bytes, 8 bits]
    return bits.reshape(qh.shape[0], 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 6:]) | (_q5_high(blocks[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).to(torch.float32)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 8:]) | (_q5_high(blocks[:, 4:8]) << 4)
    return d * q.to(torch.float32) + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    return blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K super-block from its 12 bytes."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _k_affine(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32-weight sub-block scale and offset of a Q4_K/Q5_K super-block ([n, 8, 1] each)."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mins = k_scale_min(blocks[:, 4:16])
    scale = (d * sc.to(torch.float32)).unsqueeze(-1)
    offset = (dmin * mins.to(torch.float32)).unsqueeze(-1)
    return scale, offset


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K low bits: 4 chunks of 32 bytes, each the low nibbles then the high ones of two
    32-weight sub-blocks ([n, 8, 32])."""
    chunks = qs.reshape(qs.shape[0], 4, 1, 32)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(qs.shape[0], 8, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_affine(blocks)
    q = _k_nibbles(blocks[:, 16:]).to(torch.float32)
    return (scale * q - offset).reshape(blocks.shape[0], QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_affine(blocks)
    qh = blocks[:, 16:48].reshape(blocks.shape[0], 1, 32)
    high = (qh >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1  # bit i: sub-block i
    q = (_k_nibbles(blocks[:, 48:]) | (high << 4)).to(torch.float32)
    return (scale * q - offset).reshape(blocks.shape[0], QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(blocks[:, 208:210])
    scale = (d * scales).reshape(n, 16, 1)
    low = ql.reshape(n, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(n, 8, 32)
    high = qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(
        1, 1, 4, 1
    )
    high = (high & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (scale * q).reshape(n, QK_K)


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("F32", 0, 1, 4, _f32),
        BlockFormat("F16", 1, 1, 2, _f16_values),
        BlockFormat("BF16", 30, 1, 2, _bf16_values),
        BlockFormat("Q4_0", 2, 32, 18, _q4_0),
        BlockFormat("Q4_1", 3, 32, 20, _q4_1),
        BlockFormat("Q5_0", 6, 32, 22, _q5_0),
        BlockFormat("Q5_1", 7, 32, 24, _q5_1),
        BlockFormat("Q8_0", 8, 32, 34, _q8_0),
        BlockFormat("Q4_K", 12, QK_K, 144, _q4_k),
        BlockFormat("Q5_K", 13, QK_K, 176, _q5_k),
        BlockFormat("Q6_K", 14, QK_K, 210, _q6_k),
    )
}
BY_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in FORMATS.values()}


def dequantize(raw: torch.Tensor, fmt: BlockFormat, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` (PyTorch order, last dim contiguous) from its raw GGUF bytes."""
    numel = 1
    for size in shape:
        numel *= size
    if shape[-1] % fmt.block_size:
        raise ValueError(f"{fmt.name} rows hold whole {fmt.block_size}-weight blocks")
    expected = numel // fmt.block_size * fmt.type_size
    flat = raw.reshape(-1)
    if flat.numel() != expected:
        raise ValueError(
            f"{fmt.name} tensor of shape {shape} needs {expected} bytes, has {flat.numel()}"
        )
    blocks = flat.view(-1, fmt.type_size)
    return fmt.dequantize(blocks).reshape(shape)
