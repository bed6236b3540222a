"""PyTorch twins of the paged-attention kernels: the reference every faster kernel is tested
against, and the implementation used where Triton is unavailable (CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.attention_sinks import sdpa_with_sinks, sink_bias
from dgpp.kernels.kv_quant import KvFormat


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv: KvFormat | None = None,
    fixed: torch.Tensor | None = None,
) -> None:
    """Write key/value [T, H_kv, D] into caches [blocks, block_size, H_kv, D] at `slot_mapping`
    (with a quantized `kv`, their rows [..., H_kv, kv.width]; `fixed` [2]: the checkpoint's
    static key and value scales, fp8_e4m3's)."""
    if kv is not None:
        k_fixed, v_fixed = (None, None) if fixed is None else (fixed[0], fixed[1])
        key, value = kv.encode(key, k_fixed), kv.encode(value, v_fixed)
    num_kv_heads, width = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, value)


def _rows(rows: torch.Tensor, kv: KvFormat | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as keys or values in `dtype` (quantized ones decoded)."""
    return rows if kv is None else kv.decode(rows, dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of the blocks in `block_table`: [..., length, H_kv, D]."""
    # index_select, not cache[block_table]: 4-7x faster on CPU for these block copies
    # (measured on the default model's shapes at 6,000 cached tokens: 0.2 ms a layer, not 0.9).
    blocks = torch.index_select(cache, 0, block_table.reshape(-1))
    blocks = blocks.view(*block_table.shape, *cache.shape[1:])  # [..., n_blocks, bs, H_kv, D]
    flat = blocks.flatten(-4, -3)
    return flat[..., :length, :, :]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    kv: KvFormat | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, H, D] over each sequence's cached keys; returns [T, H, D]
    (into `out` when given). With a quantized `kv` the caches hold its rows; only the rows a
    step gathers are decoded.

    `sinks` [H]: a learned logit per head that joins each softmax's denominator and adds no
    value (gpt-oss). `sliding_window`: a query at position p sees only keys k with
    p - window < k <= p; keys before a row's window are not read (decode rows gather only the
    window's slots, prefill chunks start at the window's first block)."""
    out = torch.empty_like(query) if out is None else out
    block_size = key_cache.shape[1]
    starts = metadata.query_start_loc_host
    num_decodes = metadata.num_decodes
    if num_decodes:
        decoded = starts[num_decodes]  # decode query rows (verify rows have several)
        out[:decoded] = _decode(
            query[:decoded], key_cache, value_cache, metadata, scale, sinks, sliding_window, kv
        )
    for row in range(num_decodes, metadata.num_seqs):
        begin, end = starts[row], starts[row + 1]
        seq_len = metadata.seq_lens_host[row]
        # A window as long as the sequence excludes nothing: full attention, byte for byte.
        window = sliding_window if sliding_window is not None and seq_len > sliding_window else None
        first_key = 0 if window is None else max(0, seq_len - (end - begin) - window + 1)
        first_block, num_blocks = first_key // block_size, -(-seq_len // block_size)
        table = metadata.block_tables[row, first_block:num_blocks]
        offset = first_block * block_size  # position of the first key gathered
        keys = _rows(_gather(key_cache, table, seq_len - offset), kv, query.dtype)  # [S, H_kv, D]
        values = _rows(_gather(value_cache, table, seq_len - offset), kv, query.dtype)
        out[begin:end] = _prefill(
            query[begin:end],
            keys,
            values,
            scale,
            metadata.prefill_softmax_fp32,
            offset,
            window,
            sinks,
        )
    return out


def _prefill(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    fp32: bool,
    offset: int,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Query [Q, H, D] at the last Q positions over keys/values [S, H_kv, D] at positions
    offset .. offset + S - 1."""
    q_len, num_keys = query.shape[0], keys.shape[0]
    dtype = query.dtype
    if fp32:
        query, keys, values = query.float(), keys.float(), values.float()
    # 4-D [1, H, S, D] inputs: PyTorch's CPU flash kernel only takes batched inputs (3-D ones fall
    # back to the unfused math path, about 4x slower at 1,000 tokens).
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    k = keys.transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
    v = values.transpose(0, 1).unsqueeze(0)
    if q_len == num_keys and window is None and sinks is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1).to(dtype)
    # Queries are the last q_len positions: query i sits at seq_len - q_len + i.
    seq_len = offset + num_keys
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
    k_pos = torch.arange(offset, seq_len, device=query.device).unsqueeze(0)
    mask = k_pos <= q_pos  # [Q, S]
    if window is not None:
        mask &= q_pos - k_pos < window
    if sinks is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        o = sdpa_with_sinks(q, k, v, mask, sinks, scale)
    return o[0].transpose(0, 1).to(dtype)


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None,
    sliding_window: int | None,
    kv: KvFormat | None = None,
) -> torch.Tensor:
    """Decode rows, batched: one query each, or a verify row's few (padded to the longest)."""
    slots, mask = metadata.decode_context(sliding_window)
    if sinks is not None:
        # One more key per row, zeroed after the gather: the sink's (see `attention_sinks`).
        slots = F.pad(slots, (0, 1))
    num_rows, max_len = slots.shape
    num_kv_heads, width = key_cache.shape[2], key_cache.shape[3]
    head_dim = width if kv is None else kv.head_dim
    flat_slots = slots.view(-1)
    keys = _rows(
        key_cache.view(-1, num_kv_heads, width).index_select(0, flat_slots), kv, query.dtype
    )
    values = _rows(
        value_cache.view(-1, num_kv_heads, width).index_select(0, flat_slots), kv, query.dtype
    )
    keys = keys.view(num_rows, max_len, num_kv_heads, head_dim).transpose(1, 2)  # [B, H_kv, S, D]
    values = values.view(num_rows, max_len, num_kv_heads, head_dim).transpose(1, 2)
    index = metadata.decode_query_index
    if index is None:
        queries = query.unsqueeze(2)  # [B, H, 1, D]
    else:
        num_heads = query.shape[1]
        queries = query.index_select(0, index.view(-1))  # [B * Q, H, D]
        queries = queries.view(num_rows, -1, num_heads, head_dim).transpose(1, 2)  # [B, H, Q, D]
    if sinks is not None:
        keys[:, :, -1] = 0  # the gathered copy's, not the cache's
        values[:, :, -1] = 0
        everything = torch.ones(1, 1, max_len - 1, dtype=torch.bool, device=slots.device)
        visible = mask[:, 0] if mask is not None else everything  # [B or 1, Q or 1, S]
        mask = sink_bias(visible, sinks, queries.dtype)  # [B, H, Q, S + 1]
    o = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, H, Q, D]
    if index is None:
        return o.squeeze(2)  # [B, H, D]
    o = o.transpose(1, 2).reshape(-1, o.shape[1], head_dim)  # [B * Q, H, D]
    assert metadata.decode_output_index is not None
    return o.index_select(0, metadata.decode_output_index)  # [T_dec, H, D]
