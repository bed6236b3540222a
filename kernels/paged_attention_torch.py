"""PyTorch twins of the paged-attention kernels: the reference every faster kernel is tested
against, and the implementation used where Triton is unavailable (CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels.attention_metadata import PagedAttentionMetadata


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, H_kv, D] into caches [blocks, block_size, H_kv, D] at `slot_mapping`."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of the blocks in `block_table`: [..., length, H_kv, D]."""
    blocks = cache[block_table]  # [..., n_blocks, block_size, H_kv, D]
    flat = blocks.flatten(-4, -3)
    return flat[..., :length, :, :]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of query [T, H, D] over each sequence's cached keys; returns [T, H, D]."""
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    starts = metadata.query_start_loc_host
    num_decodes = metadata.num_decodes
    if num_decodes:
        out[:num_decodes] = _decode(query[:num_decodes], key_cache, value_cache, metadata, scale)
    for row in range(num_decodes, metadata.num_seqs):
        begin, end = starts[row], starts[row + 1]
        seq_len = metadata.seq_lens_host[row]
        num_blocks = -(-seq_len // block_size)
        table = metadata.block_tables[row, :num_blocks]
        keys = _gather(key_cache, table, seq_len)  # [S, H_kv, D]
        values = _gather(value_cache, table, seq_len)
        out[begin:end] = _prefill(
            query[begin:end], keys, values, scale, metadata.prefill_softmax_fp32
        )
    return out


def _prefill(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, fp32: bool
) -> torch.Tensor:
    q_len, seq_len = query.shape[0], keys.shape[0]
    dtype = query.dtype
    if fp32:
        query, keys, values = query.float(), keys.float(), values.float()
    # 4-D [1, H, S, D] inputs: PyTorch's CPU flash kernel only takes batched inputs (3-D ones fall
    # back to the unfused math path, about 4x slower at 1,000 tokens).
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    k = keys.transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
    v = values.transpose(0, 1).unsqueeze(0)
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Queries are the last q_len positions: query i sees keys 0 .. seq_len - q_len + i.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= q_pos  # [Q, S]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).to(dtype)


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    slots = metadata.decode_slots
    assert slots is not None, "decode rows need decode_slots"
    num_decodes, max_len = slots.shape
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_slots = slots.view(-1)
    keys = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, flat_slots)
    values = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, flat_slots)
    keys = keys.view(num_decodes, max_len, num_kv_heads, head_dim).transpose(
        1, 2
    )  # [B, H_kv, S, D]
    values = values.view(num_decodes, max_len, num_kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        keys,
        values,
        attn_mask=metadata.decode_mask,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)  # [B, H, D]


def decode_gather_inputs(
    block_tables: list[list[int]], seq_lens: list[int], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-step inputs of the decode path: the cache slot of every context token of every decode
    row [B, S_max] (padding points at slot 0) and the padding mask, None when rows are equal."""
    max_len = max(seq_lens)
    positions = torch.arange(max_len)
    tables = torch.tensor(
        [
            table[: -(-max_len // block_size)] + [0] * (-(-max_len // block_size) - len(table))
            for table in block_tables
        ]
    )  # [B, blocks]
    slots = tables[:, positions // block_size] * block_size + positions % block_size
    valid = positions.unsqueeze(0) < torch.tensor(seq_lens).unsqueeze(1)  # [B, S]
    slots = slots.masked_fill(~valid, 0)
    mask = None if min(seq_lens) == max_len else valid[:, None, None, :].to(device)
    return slots.to(device), mask
