"""Rotary embedding applied with the KV-cache store in one pass (Triton): the twin of
`rope_store_torch.rope_store`, same signature.

One program per token loads its angles once, rotates every query head into the output, and
rotates every key head and writes it, with the value heads, straight into the token's cache
slot: the rotated key is never written anywhere else. Arithmetic in float32, stored in the
tensors' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_store_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    q_out_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    stride_qt: int,
    stride_qh: int,
    stride_kt: int,
    stride_kh: int,
    stride_vt: int,
    stride_vh: int,
    stride_ct: int,
    stride_st: int,
    stride_ot: int,
    stride_oh: int,
    stride_kb: int,
    stride_ks: int,
    stride_kc: int,
    stride_vb: int,
    stride_vs: int,
    stride_vc: int,
    NUM_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    NUM_KV: tl.constexpr,
    KV_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
) -> None:
    token = tl.program_id(0)
    d = tl.arange(0, DIM_P2)
    d_ok = d < HEAD_DIM
    half = (d + HEAD_DIM // 2) % HEAD_DIM  # roll by D/2: element d takes x[(d + D/2) % D]
    cos = tl.load(cos_ptr + token * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)

    h = tl.arange(0, HEADS_P2)
    q_mask = (h < NUM_HEADS)[:, None] & d_ok[None, :]
    q_at = q_ptr + token * stride_qt + h[:, None] * stride_qh
    q = tl.load(q_at + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q_rolled = tl.load(q_at + half[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q_rot = q * cos[None, :] + q_rolled * sin[None, :]
    tl.store(
        q_out_ptr + token * stride_ot + h[:, None] * stride_oh + d[None, :],
        q_rot.to(q_out_ptr.dtype.element_ty),
        mask=q_mask,
    )

    slot = tl.load(slot_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    c = tl.arange(0, KV_P2)
    kv_mask = (c < NUM_KV)[:, None] & d_ok[None, :]
    k_at = k_ptr + token * stride_kt + c[:, None] * stride_kh
    k = tl.load(k_at + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    k_rolled = tl.load(k_at + half[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    k_rot = k * cos[None, :] + k_rolled * sin[None, :]
    k_slot = k_cache_ptr + block * stride_kb + offset * stride_ks + c[:, None] * stride_kc
    tl.store(k_slot + d[None, :], k_rot.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v = tl.load(v_ptr + token * stride_vt + c[:, None] * stride_vh + d[None, :], mask=kv_mask)
    v_slot = v_cache_ptr + block * stride_vb + offset * stride_vs + c[:, None] * stride_vc
    tl.store(v_slot + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rope_store_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    angles: tuple[torch.Tensor, torch.Tensor],
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """As `rope_store_torch.rope_store`."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv = key.shape[1]
    assert head_dim % 2 == 0, "rotate-half pairs each dim with the one D/2 away"
    cos, sin = (a.reshape(a.shape[0], -1) for a in angles)  # [T, D]
    out = torch.empty_like(query)
    for tensor in (query, key, value, cos, sin, key_cache, value_cache):
        assert tensor.stride(-1) == 1, "head dimensions are contiguous"
    if num_tokens == 0:
        return out
    _rope_store_kernel[(num_tokens,)](
        query, key, value, cos, sin, out, key_cache, value_cache, slot_mapping,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_HEADS=num_heads, HEADS_P2=triton.next_power_of_2(num_heads), NUM_KV=num_kv,
        KV_P2=triton.next_power_of_2(num_kv), HEAD_DIM=head_dim,
        DIM_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1],
    )  # fmt: skip
    return out
