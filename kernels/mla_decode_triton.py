"""Triton decode for multi-head latent attention (MLA, DeepSeek-V3) over the paged latent cache:
the absorbed form, in latent space.

A decode (or verify) token's heads score the cached latents directly: head h's query is
`q_latent[h]` [L] (q_nope folded through W_uk) beside its rope part `q_pe[h]` [R], a cached
token's key is its row `[c, k_pe]` [L + R] and its value `c` [L]; the output is the softmax-
weighted sum of the `c`s [H, L] (W_uv is applied after, by the backend). Every head reads the
same latents, so one program serves a block of 16 heads of one token: it walks the token's keys
32 (float32: 16) at a time through the block table (any power-of-two page size), with `tl.dot`
products and an online float32 softmax, reading each latent once per 16 heads.

`mla_decode_torch` is the twin, same signature: the token's latents gathered and attended in
PyTorch (float32 or the inputs' dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.dispatch import float32_products
from dgpp.kernels.kv_quant_triton import kv_params, load_kv
from dgpp.kernels.latent_quant import RowFormat, read_rows
from dgpp.kernels.online_softmax import online_softmax_step

HEAD_BLOCK = 16  # heads per program (the smallest `tl.dot` operand)
# Keys per step of the walk: a [keys, 512] latent tile, double-buffered, stays within GB10's
# 99 KiB of shared memory per block (2 x 32 x 512 x 2 bytes = 64 KiB; float32 takes 16 keys).
KEYS = {2: 32, 4: 16}


def mla_decode_torch(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    kv: RowFormat | None = None,
) -> torch.Tensor:
    """q_latent [T, H, L], q_pe [T, H, R] of the step's first T tokens (its decode rows), cache
    [blocks, block_size, L + R] (with `kv`, quantized rows: `kernels.latent_quant`) -> the
    latent-space output [T, H, L]."""
    num_tokens, rank = q_latent.shape[0], q_latent.shape[-1]
    rows, positions = metadata.rows_and_positions(num_tokens)
    block_size = cache.shape[1]
    keys = torch.arange(metadata.max_seq_len, device=cache.device)
    tables = metadata.block_tables[rows.long()]  # [T, max_blocks]
    pages = (keys // block_size).clamp(max=tables.shape[1] - 1)
    slots = tables[:, pages] * block_size + keys % block_size  # [T, S]
    latents = read_rows(cache.view(-1, cache.shape[-1])[slots], kv, q_latent.dtype)  # [T, S, L + R]
    query = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, L + R]
    scores = torch.einsum("thd,tsd->ths", query, latents) * scale
    visible = keys[None, :] <= positions[:, None].long()  # [T, S]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    wide = torch.promote_types(scores.dtype, torch.float32)  # float32 at least
    weights = scores.to(wide).softmax(dim=-1).to(latents.dtype)
    return torch.einsum("ths,tsl->thl", weights, latents[..., :rank])


@triton.jit
def _mla_decode_kernel(
    q_ptr: tl.tensor,
    pe_ptr: tl.tensor,
    cache_ptr: tl.tensor,
    rope_ptr: tl.tensor,
    out_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    token_row_ptr: tl.tensor,
    token_pos_ptr: tl.tensor,
    scale: float,
    num_heads: int,
    stride_qt: int,
    stride_qh: int,
    stride_pt: int,
    stride_ph: int,
    stride_cb: int,
    stride_cs: int,
    stride_rb: int,
    stride_rs: int,
    stride_ot: int,
    stride_oh: int,
    stride_bt: int,
    RANK: tl.constexpr,
    RANK_P2: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P2: tl.constexpr,
    ROPE_AT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    KEYS_PER_STEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    KV_KIND: tl.constexpr,
    KV_GROUP: tl.constexpr,
    KV_BLOCK_BYTES: tl.constexpr,
) -> None:
    token = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    head_ok = heads < num_heads
    row = tl.load(token_row_ptr + token)
    pos = tl.load(token_pos_ptr + token)
    c = tl.arange(0, RANK_P2)
    c_ok = c < RANK
    r = tl.arange(0, ROPE_P2)
    r_ok = r < ROPE
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + c[None, :],
        mask=head_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    pe = tl.load(
        pe_ptr + token * stride_pt + heads[:, None] * stride_ph + r[None, :],
        mask=head_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    if F32_DOT:
        q, pe = q.to(tl.float32), pe.to(tl.float32)
    m_i = tl.full([HEADS], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, RANK_P2], tl.float32)
    n = tl.arange(0, KEYS_PER_STEP)
    for start in range(0, pos + 1, KEYS_PER_STEP):
        key_pos = start + n
        key_ok = key_pos <= pos
        block = tl.load(
            block_tables_ptr + row * stride_bt + key_pos // BLOCK_SIZE, mask=key_ok, other=0
        )
        slot = key_pos % BLOCK_SIZE
        at = cache_ptr + block * stride_cb + slot * stride_cs
        key_mask = key_ok[:, None] & c_ok[None, :]
        if KV_KIND == 0:
            latent = tl.load(at[:, None] + c[None, :], mask=key_mask, other=0.0)
        else:  # quantized rows: the latent's blocks read and scaled here, never stored wide
            latent = load_kv(at, c, key_mask, KV_KIND, KV_GROUP, KV_BLOCK_BYTES).to(q.dtype)
        rope_at = rope_ptr + block * stride_rb + slot * stride_rs + ROPE_AT
        k_pe = tl.load(
            rope_at[:, None] + r[None, :], mask=key_ok[:, None] & r_ok[None, :], other=0.0
        )
        if F32_DOT:
            latent, k_pe = latent.to(tl.float32), k_pe.to(tl.float32)
            scores = tl.dot(q, tl.trans(latent), input_precision="ieee")
            scores = tl.dot(pe, tl.trans(k_pe), scores, input_precision="ieee")
        else:
            scores = tl.dot(pe, tl.trans(k_pe), tl.dot(q, tl.trans(latent)))
        scores = tl.where(key_ok[None, :], scores * scale, float("-inf"))
        m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, scores)
        if F32_DOT:
            acc = tl.dot(p, latent, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(latent.dtype), latent, acc * alpha[:, None])
        m_i = m_new
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + c[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & c_ok[None, :],
    )


def mla_decode_triton(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    kv: RowFormat | None = None,
) -> torch.Tensor:
    """As `mla_decode_torch`."""
    num_tokens, num_heads, rank = q_latent.shape
    rope, block_size = q_pe.shape[-1], cache.shape[1]
    assert block_size & (block_size - 1) == 0, "pages hold a power-of-two number of tokens"
    assert cache.stride(-1) == 1
    if kv is None:
        assert cache.shape[-1] == rank + rope
        rope_view, rope_at = cache, rank
    else:  # the rope key's bytes, in the model dtype, after the latent's codes
        assert cache.shape[-1] == kv.width(q_pe.dtype) and kv.kept == rope
        rope_view, rope_at = cache.view(q_pe.dtype), kv.codes_bytes // q_pe.dtype.itemsize
    out = torch.empty_like(q_latent)
    if num_tokens == 0:
        return out
    rows, positions = metadata.rows_and_positions(num_tokens)
    tables = metadata.block_tables
    f32 = float32_products(q_latent.dtype)
    _mla_decode_kernel[(num_tokens, triton.cdiv(num_heads, HEAD_BLOCK))](
        q_latent, q_pe, cache, rope_view, out, tables, rows, positions, scale, num_heads,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), rope_view.stride(0), rope_view.stride(1),
        out.stride(0), out.stride(1), tables.stride(0),
        RANK=rank, RANK_P2=max(16, triton.next_power_of_2(rank)), ROPE=rope,
        ROPE_P2=max(16, triton.next_power_of_2(rope)), ROPE_AT=rope_at, BLOCK_SIZE=block_size,
        HEADS=HEAD_BLOCK, KEYS_PER_STEP=KEYS[4 if f32 else 2], F32_DOT=f32,
        **kv_params(None if kv is None else kv.codes), num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
