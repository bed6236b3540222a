"""Triton paged attention: every row of a step (decode, speculative verify, prefill chunk over a
cached prefix) read straight from the paged cache through its block table.

`paged_attention_triton` has the signature of its twin `paged_attention_torch.paged_attention`
and agrees with it up to the order of float32 sums. One program serves one query token and one
KV head: it loads the queries of every head sharing that KV head (GQA), walks the token's key
pages from the first visible one (a sliding window starts later) to its own position, and keeps
an online softmax in float32 (scores, running maximum and denominator; a sink's logit starts
the denominator, gpt-oss). Keys past the token's position are masked, so a verify row's queries
and a prefill chunk's are causal among themselves.

Decode reads each key page once per KV head, which is what bounds it (memory). Prefill rows go
to the tiled kernel (`paged_prefill_triton`), which reads each key once per tile of query
tokens; split-K decode for very long contexts is still to come (issue 36).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.dispatch import float32_products
from dgpp.kernels.kv_quant import KvFormat
from dgpp.kernels.kv_quant_triton import kv_params, load_kv
from dgpp.kernels.online_softmax import online_softmax_step
from dgpp.kernels.paged_decode_split import PARTITION_KEYS, combine_partitions, decode_split
from dgpp.kernels.paged_prefill_triton import prefill_attention_triton, prefill_tile_starts


@triton.jit
def _paged_attention_kernel(
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    out_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    token_row_ptr: tl.tensor,
    token_pos_ptr: tl.tensor,
    sinks_ptr: tl.tensor,
    part_ptr: tl.tensor,
    stat_ptr: tl.tensor,
    scale: float,
    window: int,
    pages_per_part: int,
    num_parts: int,
    stat_plane: int,
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
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    KV_KIND: tl.constexpr,
    KV_GROUP: tl.constexpr,
    KV_BLOCK_BYTES: tl.constexpr,
) -> None:
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(token_row_ptr + token)
    pos = tl.load(token_pos_ptr + token)  # the query's own position: its last visible key

    g = tl.arange(0, GROUP_P2)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    d = tl.arange(0, DIM_P2)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=head_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)

    first = 0
    if HAS_WINDOW:
        first = tl.maximum(pos - window + 1, 0)
    lo = first // BLOCK_SIZE
    hi = pos // BLOCK_SIZE + 1
    if SPLIT:  # this program's share of the pages; the sink joins in `combine_partitions`
        part = tl.program_id(2)
        lo = tl.maximum(lo, part * pages_per_part)
        hi = tl.minimum(hi, (part + 1) * pages_per_part)
        m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P2], tl.float32)
    elif HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
        l_i = tl.full([GROUP_P2], 1.0, tl.float32)  # exp(sink - m_i): it joins the denominator
    else:
        m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)

    s = tl.arange(0, BLOCK_SIZE)
    for page in range(lo, hi):
        block = tl.load(block_tables_ptr + row * stride_bt + page)
        k_at = k_cache_ptr + block * stride_kb + kv_head * stride_kh
        v_at = v_cache_ptr + block * stride_vb + kv_head * stride_vh
        kv = (KV_KIND, KV_GROUP, KV_BLOCK_BYTES)
        k = load_kv(k_at + s * stride_ks, d, d_ok[None, :], *kv)  # float32 [BLOCK_SIZE, DIM]
        v = load_kv(v_at + s * stride_vs, d, d_ok[None, :], *kv)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP, BLOCK_SIZE]
        key_pos = page * BLOCK_SIZE + s
        visible = (key_pos >= first) & (key_pos <= pos)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, scores)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    if SPLIT:  # unnormalised: running maximum, denominator and weighted sum per partition
        at = (token * (GROUP * tl.num_programs(1)) + heads) * num_parts + part
        tl.store(stat_ptr + at, m_i, mask=head_ok)
        tl.store(stat_ptr + stat_plane + at, l_i, mask=head_ok)
        tl.store(
            part_ptr + at[:, None] * HEAD_DIM + d[None, :],
            acc,
            mask=head_ok[:, None] & d_ok[None, :],
        )
    else:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None] & d_ok[None, :],
        )


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    partition_keys: int = PARTITION_KEYS,
    kv: KvFormat | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, H, D] over each row's cached keys and values
    ([blocks, block_size, H_kv, D], or a quantized `kv`'s rows); returns [T, H, D] (into `out`
    when given). `partition_keys`: the shortest share of a context one split-K decode program
    reads."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads come in whole groups per KV head"
    assert block_size & (block_size - 1) == 0, "pages hold a power-of-two number of tokens"
    out = torch.empty_like(query) if out is None else out
    for tensor in (query, key_cache, value_cache, out):
        assert tensor.stride(-1) == 1, "head dimensions are contiguous"
    if num_tokens == 0:
        return out
    rows, positions = metadata.rows_and_positions(num_tokens)
    tables = metadata.block_tables
    decoded = metadata.query_start_loc_host[metadata.num_decodes]  # decode and verify rows'
    if num_tokens > decoded:
        tiles = metadata.prefill_tile_starts
        if tiles is None:
            starts = prefill_tile_starts(metadata.query_start_loc_host, metadata.num_decodes)
            tiles = torch.tensor(starts, dtype=torch.int32, device=query.device)
        f32 = float32_products(query.dtype) or metadata.prefill_softmax_fp32
        prefill_attention_triton(
            query, key_cache, value_cache, out, tables, metadata.query_start_loc, tiles, rows,
            positions, scale, sinks, sliding_window, f32, kv,
        )  # fmt: skip
    if not decoded:
        return out
    group = num_heads // num_kv_heads
    split = decode_split(decoded, num_kv_heads, metadata.max_seq_len, block_size, partition_keys)
    pages_per_part, num_parts = split if split is not None else (0, 1)
    part = stat = out  # never read without a split
    if split is not None:
        part = torch.empty(decoded, num_heads, num_parts, head_dim, device=query.device)
        stat = torch.empty(2, decoded, num_heads, num_parts, device=query.device)
    _paged_attention_kernel[(decoded, num_kv_heads, num_parts)](
        query, key_cache, value_cache, out, tables, rows, positions,
        sinks if sinks is not None else query,  # never read without sinks
        part, stat, scale, sliding_window or 0, pages_per_part, num_parts,
        decoded * num_heads * num_parts,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0),
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        DIM_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        HAS_SINKS=sinks is not None, HAS_WINDOW=sliding_window is not None,
        SPLIT=split is not None, **kv_params(kv),
    )  # fmt: skip
    if split is not None:
        combine_partitions(part, stat, sinks, out[:decoded])
    return out
