"""Triton prefill attention over the paged cache: a prompt chunk's queries, in tiles, against
its row's cached prefix and itself (causal), keys read once per tile instead of once per token.

One program serves a tile of up to `TILE_TOKENS` consecutive query tokens of one prefill row
and one KV head: the tile's queries of every head sharing that KV head (GQA) form the rows of
one [tokens x group, D] operand, and the program walks the row's keys `KEYS` at a time (each key
found through the block table, so any power-of-two page size works), with `tl.dot` products
and an online softmax in float32; a sink's logit starts the denominator (gpt-oss), a sliding
window skips the keys before the tile's first window. Products are float32 when the rows are
float32 or the step keeps prefill attention in float32 (`prefill_softmax_fp32`), else in the
model dtype with float32 accumulation.

Tiles are listed by their first token (`prefill_tile_starts`), built on the host once per step
by the Triton backend; `paged_attention_triton` runs decode and verify rows through the
per-token kernel and the prefill rows through this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dgpp.kernels.kv_quant import KvFormat
from dgpp.kernels.kv_quant_triton import kv_params, load_kv
from dgpp.kernels.online_softmax import online_softmax_step

TILE_TOKENS = 16  # query tokens per tile
KEYS = 32  # keys per step of the walk, at most
# A step's key and value tiles, double-buffered, stay within GB10's 99 KiB of shared memory per
# block (sm_121): at most this much per stage.
STAGE_BYTES = 32 * 1024


def keys_per_step(dim_p2: int, element_bytes: int) -> int:
    """Keys per step for heads of `dim_p2` (padded) dims of `element_bytes` each: 32, fewer
    for wide float32 heads (16 for 256-dim float32 heads)."""
    return max(16, min(KEYS, STAGE_BYTES // (2 * dim_p2 * element_bytes)))


def prefill_tile_starts(query_starts: tuple[int, ...], num_decodes: int) -> list[int]:
    """The first token of every tile of the prefill rows (rows `num_decodes ..`)."""
    starts: list[int] = []
    for row in range(num_decodes, len(query_starts) - 1):
        starts.extend(range(query_starts[row], query_starts[row + 1], TILE_TOKENS))
    return starts


@triton.jit
def _prefill_kernel(
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    out_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    query_start_ptr: tl.tensor,
    tile_start_ptr: tl.tensor,
    token_row_ptr: tl.tensor,
    token_pos_ptr: tl.tensor,
    sinks_ptr: tl.tensor,
    scale: float,
    window: int,
    stride_qt: int,
    stride_qh: int,
    stride_kb: int,
    stride_ks: int,
    stride_kh: int,
    stride_vb: int,
    stride_vs: int,
    stride_vh: int,
    stride_ot: int,
    stride_oh: int,
    stride_bt: int,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    KEYS_PER_STEP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    F32_DOT: tl.constexpr,
    KV_KIND: tl.constexpr,
    KV_GROUP: tl.constexpr,
    KV_BLOCK_BYTES: tl.constexpr,
) -> None:
    first_token = tl.load(tile_start_ptr + tl.program_id(0))
    kv_head = tl.program_id(1)
    row = tl.load(token_row_ptr + first_token)
    row_end = tl.load(query_start_ptr + row + 1)

    m = tl.arange(0, TILE * GROUP_P2)  # operand row m: token m // GROUP_P2, head m % GROUP_P2
    token = first_token + m // GROUP_P2
    g = m % GROUP_P2
    valid = (token < row_end) & (g < GROUP)
    token = tl.where(valid, token, first_token)
    heads = kv_head * GROUP + g
    pos = tl.load(token_pos_ptr + token)  # each query's position: its last visible key
    d = tl.arange(0, DIM_P2)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=valid[:, None] & d_ok[None, :],
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)

    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=valid, other=0.0).to(tl.float32)
        l_i = tl.full([TILE * GROUP_P2], 1.0, tl.float32)
    else:
        m_i = tl.full([TILE * GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([TILE * GROUP_P2], tl.float32)
    acc = tl.zeros([TILE * GROUP_P2, DIM_P2], tl.float32)

    last = tl.max(tl.where(valid, pos, 0))  # the tile's last query position
    lowest = tl.min(tl.where(valid, pos, last))
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(lowest - window + 1, 0) // KEYS_PER_STEP * KEYS_PER_STEP
    n = tl.arange(0, KEYS_PER_STEP)
    for key_start in range(start, last + 1, KEYS_PER_STEP):
        key_pos = key_start + n
        key_ok = key_pos <= last
        block = tl.load(
            block_tables_ptr + row * stride_bt + key_pos // BLOCK_SIZE, mask=key_ok, other=0
        )
        slot = key_pos % BLOCK_SIZE
        k_at = k_cache_ptr + block * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_at = v_cache_ptr + block * stride_vb + slot * stride_vs + kv_head * stride_vh
        kv_mask = key_ok[:, None] & d_ok[None, :]
        if KV_KIND == 0:
            k = tl.load(k_at[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_at[:, None] + d[None, :], mask=kv_mask, other=0.0)
        else:  # quantized rows, decoded in registers, in the queries' dtype
            kv = (KV_KIND, KV_GROUP, KV_BLOCK_BYTES)
            k = load_kv(k_at, d, kv_mask, *kv).to(q.dtype)
            v = load_kv(v_at, d, kv_mask, *kv).to(q.dtype)
        if F32_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale  # [TILE * GROUP, KEYS]
        visible = (key_pos[None, :] <= pos[:, None]) & valid[:, None]
        if HAS_WINDOW:
            visible = visible & (key_pos[None, :] > pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, scores)
        if F32_DOT:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & d_ok[None, :],
    )


def prefill_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    tile_starts: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    sliding_window: int | None,
    f32_dot: bool,
    kv: KvFormat | None = None,
) -> None:
    """Attention of the prefill tiles starting at `tile_starts`, written into `out` (caches of
    a quantized `kv`'s rows where given)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    dim_p2 = max(16, triton.next_power_of_2(head_dim))
    _prefill_kernel[(tile_starts.shape[0], num_kv_heads)](
        query, key_cache, value_cache, out, tables, query_start_loc, tile_starts, rows,
        positions, sinks if sinks is not None else query, scale, sliding_window or 0,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0),
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        DIM_P2=dim_p2, BLOCK_SIZE=block_size, TILE=TILE_TOKENS,
        KEYS_PER_STEP=keys_per_step(dim_p2, 4 if f32_dot else query.element_size()),
        HAS_SINKS=sinks is not None, HAS_WINDOW=sliding_window is not None, F32_DOT=f32_dot,
        **kv_params(kv),
        num_warps=4, num_stages=2,
    )  # fmt: skip
