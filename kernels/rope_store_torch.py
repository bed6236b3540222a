"""Rotary embedding applied with the KV-cache store, in PyTorch: the twin of
`rope_store_triton.rope_store_triton` and the reference of `apply_rotary`'s arithmetic.

The angles are `(cos, signed sin)`, each [T, 1, D] in the rotate-half layout (the first half of
`sin` negated), as `RotaryEmbedding.lookup` gives them: x rotated is x * cos + roll(x, D/2) *
sin.
"""

from __future__ import annotations

import torch

from dgpp.kernels.kv_quant import KvFormat
from dgpp.kernels.paged_attention_torch import store_kv


def apply_rotary(x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x [T, heads, D] (rotate-half layout) by (cos, signed sin) [T, 1, D]."""
    cos, sin = angles
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def rope_store(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    angles: tuple[torch.Tensor, torch.Tensor],
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv: KvFormat | None = None,
) -> torch.Tensor:
    """Rotate query [T, H, D] and key [T, H_kv, D], store the rotated key and value [T, H_kv, D]
    at `slot_mapping` in the caches [blocks, block_size, H_kv, D] (quantized rows with `kv`);
    returns the rotated query."""
    store_kv(apply_rotary(key, angles), value, key_cache, value_cache, slot_mapping, kv)
    return apply_rotary(query, angles)
