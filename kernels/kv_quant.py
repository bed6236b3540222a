"""Quantized KV-cache rows (`engine.kv_cache_dtype`): each cached key or value head [D] is stored
as bytes, in blocks of `group` elements, each block its float16 scale `d` first and its codes
after, so a cache pool stays one tensor (uint8 [..., H_kv, width]) that the prefix cache's tiers
copy as they are, and a reader dequantizes only the rows it gathers.

- `int8`: ggml's Q8_0 blocks byte for byte where D is a multiple of 32 (d = max|x| / 127, codes
  round(x / d) half away from zero, computed with the float32 d as ggml does); 34 bytes per 32.
- `int4`: ggml's Q4_0 (d = the signed value of largest magnitude / -8, codes trunc(x / d + 8.5)
  clamped to 0..15, the block's first half in the low nibbles); 18 bytes per 32.
- `fp8_e4m3`: one block per head (e4m3's exponent carries the range a 32-wide scale gives int8):
  d = max|x| / 448 first, then the e4m3 codes of x / d; D + 2 bytes, 1.97x a 16-bit cache's
  tokens per byte at D = 128 (Q8_0's blocks give 1.88x). With a checkpoint's own static scale
  (`k_scale`/`v_scale`: ModelOpt's and compressed-tensors' FP8 KV), d is that scale, rounded to
  float16, for every row, and the codes saturate at +-448, as their calibration assumes.

For int8 and int4 a head dimension that is not a multiple of 32 is one block of D (even, for
int4). Only the
rows a step reads are dequantized (`decode`), never a whole cache."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

KV_DTYPES = ("auto", "fp8_e4m3", "int8", "int4")
GGML_BLOCK = 32
_LIMIT = {"int8": 127.0, "fp8_e4m3": 448.0}


@dataclass(frozen=True)
class KvFormat:
    name: str  # "int8", "int4" or "fp8_e4m3"
    head_dim: int
    group: int  # elements per scale

    @property
    def groups(self) -> int:
        return self.head_dim // self.group

    @property
    def block_bytes(self) -> int:
        return 2 + (self.group // 2 if self.name == "int4" else self.group)

    @property
    def width(self) -> int:
        """Bytes of one cached head."""
        return self.groups * self.block_bytes

    def encode(self, x: torch.Tensor, fixed: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., D] -> uint8 [..., width]. `fixed`: a static scale (a 0-d tensor, fp8_e4m3
        only) in place of each row's own."""
        lead = x.shape[:-1]
        blocks = x.reshape(-1, self.groups, self.group).float()
        if fixed is not None:
            assert self.name == "fp8_e4m3", "static KV scales are fp8_e4m3's"
            scale, codes = _fixed_codes(blocks, fixed)
        elif self.name == "int4":
            scale, codes = _int4_codes(blocks)
        else:
            scale, codes = _scaled_codes(blocks, self.name)
        packed = torch.cat((scale.to(torch.float16).view(torch.uint8), codes), dim=-1)
        return packed.reshape(*lead, self.width)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [..., width] -> [..., D] in `dtype`."""
        lead = rows.shape[:-1]
        blocks = rows.reshape(-1, self.groups, self.block_bytes)
        scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [N, G, 1]
        codes = blocks[..., 2:]
        if self.name == "int8":
            values = codes.view(torch.int8).float()
        elif self.name == "fp8_e4m3":
            values = codes.view(torch.float8_e4m3fn).float()
        else:
            low, high = (codes & 0x0F).float(), (codes >> 4).float()
            values = torch.cat((low, high), dim=-1) - 8.0
        return (values * scale).to(dtype).reshape(*lead, self.head_dim)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (ggml's Q8_0), not to even; exact where |x| + 0.5
    would round up in float32 (0.49999997)."""
    magnitude = x.abs()
    whole = torch.floor(magnitude)
    return torch.sign(x) * (whole + torch.floor(2 * (magnitude - whole)))


def _scaled_codes(blocks: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = blocks.abs().amax(dim=-1, keepdim=True) / _LIMIT[name]
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    scaled = blocks * inverse
    if name == "int8":
        codes = _roundf(scaled).to(torch.int8).view(torch.uint8)
    else:
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return d, codes


def _fixed_codes(blocks: torch.Tensor, fixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of x / d for a static d (no host sync: graph-safe), saturated at +-448."""
    d = fixed.to(torch.float16).float().reshape(1, 1, 1).expand(*blocks.shape[:-1], 1)
    limit = _LIMIT["fp8_e4m3"]
    codes = (blocks / d).clamp(-limit, limit).to(torch.float8_e4m3fn).view(torch.uint8)
    return d, codes


def _int4_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    largest = blocks.abs().argmax(dim=-1, keepdim=True)
    d = blocks.gather(-1, largest) / -8.0
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    codes = torch.trunc(blocks * inverse + 8.5).clamp(0, 15).to(torch.uint8)
    half = blocks.shape[-1] // 2
    return d, codes[..., :half] | (codes[..., half:] << 4)


@cache
def kv_format(name: str, head_dim: int) -> KvFormat | None:
    """The format of `name` for heads of `head_dim`; None for `auto` (the model dtype)."""
    if name == "auto":
        return None
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: expected one of {', '.join(KV_DTYPES)}")
    group = GGML_BLOCK if head_dim % GGML_BLOCK == 0 and name != "fp8_e4m3" else head_dim
    if name == "int4" and group % 2:
        raise ValueError(f"int4 KV needs an even head dimension, not {head_dim}")
    return KvFormat(name, head_dim, group)
