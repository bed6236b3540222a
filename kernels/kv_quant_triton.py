"""Quantized KV rows read inside Triton kernels (`kernels.kv_quant`'s layout): `load_kv` gives
float32 keys or values for a set of cache rows, whatever the cache stores. `KIND` 0 is the model
dtype's cache (a plain load); 1 int8 (Q8_0 blocks), 2 fp8_e4m3 (a scale per head), 3 int4 (Q4_0
blocks): each element is its block's float16 scale, read as two bytes, times its code."""

from __future__ import annotations

import triton
import triton.language as tl

from dgpp.kernels.kv_quant import KvFormat

KINDS = {None: 0, "int8": 1, "fp8_e4m3": 2, "int4": 3}


def kv_params(kv: KvFormat | None) -> dict[str, int]:
    """The kernels' constexprs for `kv` (None: the model dtype's cache)."""
    if kv is None:
        return {"KV_KIND": 0, "KV_GROUP": 1, "KV_BLOCK_BYTES": 1}
    return {"KV_KIND": KINDS[kv.name], "KV_GROUP": kv.group, "KV_BLOCK_BYTES": kv.block_bytes}


@triton.jit
def load_kv(
    rows: tl.tensor,
    d: tl.tensor,
    mask: tl.tensor,
    KV_KIND: tl.constexpr,
    KV_GROUP: tl.constexpr,
    KV_BLOCK_BYTES: tl.constexpr,
) -> tl.tensor:
    """float32 [N, DIM] of the cache rows starting at pointers `rows` [N], dims `d` [DIM]."""
    if KV_KIND == 0:
        return tl.load(rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    inner = d % KV_GROUP
    base = rows[:, None] + ((d // KV_GROUP) * KV_BLOCK_BYTES)[None, :]
    low = tl.load(base, mask=mask, other=0).to(tl.uint16)
    high = tl.load(base + 1, mask=mask, other=0).to(tl.uint16)
    scale = (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    if KV_KIND == 1:
        code = tl.load(base + 2 + inner[None, :], mask=mask, other=0)
        value = code.to(tl.int8, bitcast=True).to(tl.float32)
    elif KV_KIND == 2:
        code = tl.load(base + 2 + inner[None, :], mask=mask, other=0)
        value = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        half = KV_GROUP // 2
        byte = tl.load(base + 2 + (inner % half)[None, :], mask=mask, other=0)
        nibble = tl.where((inner >= half)[None, :], byte >> 4, byte & 15)
        value = nibble.to(tl.float32) - 8.0
    return value * scale
