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
        decoded = starts[num_decodes]  # decode query rows (verify rows have several)
        out[:decoded] = _decode(query[:decoded], key_cache, value_cache, metadata, scale)
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
    """Decode rows, batched: one query each, or a verify row's few (padded to the longest)."""
    slots = metadata.decode_slots
    assert slots is not None, "decode rows need decode_slots"
    num_rows, max_len = slots.shape
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_slots = slots.view(-1)
    keys = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, flat_slots)
    values = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, flat_slots)
    keys = keys.view(num_rows, max_len, num_kv_heads, head_dim).transpose(1, 2)  # [B, H_kv, S, D]
    values = values.view(num_rows, max_len, num_kv_heads, head_dim).transpose(1, 2)
    index = metadata.decode_query_index
    if index is None:
        queries = query.unsqueeze(2)  # [B, H, 1, D]
    else:
        num_heads = query.shape[1]
        queries = query.index_select(0, index.view(-1))  # [B * Q, H, D]
        queries = queries.view(num_rows, -1, num_heads, head_dim).transpose(1, 2)  # [B, H, Q, D]
    o = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=metadata.decode_mask, scale=scale, enable_gqa=True
    )  # [B, H, Q, D]
    if index is None:
        return o.squeeze(2)  # [B, H, D]
    o = o.transpose(1, 2).reshape(-1, o.shape[1], head_dim)  # [B * Q, H, D]
    assert metadata.decode_output_index is not None
    return o.index_select(0, metadata.decode_output_index)  # [T_dec, H, D]


def decode_gather_inputs(
    block_tables: list[list[int]],
    seq_lens: list[int],
    block_size: int,
    device: torch.device,
    query_lens: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-step inputs of the decode path: the cache slot of every context token of every decode
    row [B, S_max] (padding points at slot 0) and the attention mask [B, 1, Q_max, S_max], None
    when every row has one query and the rows are equally long. With `query_lens` (verify rows:
    the last `query_lens[b]` of row b's `seq_lens[b]` tokens are queries), query q of row b sees
    the tokens before it and itself; padded queries repeat the row's last one."""
    max_len = max(seq_lens)
    positions = torch.arange(max_len)
    tables = torch.tensor(
        [
            table[: -(-max_len // block_size)] + [0] * (-(-max_len // block_size) - len(table))
            for table in block_tables
        ]
    )  # [B, blocks]
    slots = tables[:, positions // block_size] * block_size + positions % block_size
    lengths = torch.tensor(seq_lens)
    valid = positions.unsqueeze(0) < lengths.unsqueeze(1)  # [B, S]
    slots = slots.masked_fill(~valid, 0)
    if query_lens is None or max(query_lens) == 1:
        mask = None if min(seq_lens) == max_len else valid[:, None, None, :].to(device)
        return slots.to(device), mask
    counts = torch.tensor(query_lens)  # [B]
    steps = torch.arange(max(query_lens)).unsqueeze(0)  # [1, Q]
    # Row b's query q sits at position seq_len - query_len + min(q, query_len - 1).
    last = (lengths - counts).unsqueeze(1) + torch.minimum(steps, (counts - 1).unsqueeze(1))
    mask = positions.view(1, 1, -1) <= last.unsqueeze(2)  # [B, Q, S]
    return slots.to(device), mask.unsqueeze(1).to(device)


def decode_query_index(
    query_lens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For decode rows with several queries: where each padded query [B, Q_max] comes from in
    the step's decode queries, and where each decode query's output sits in the padded [B *
    Q_max] outputs. None when every row has exactly one query."""
    width = max(query_lens)
    if width == 1:
        return None
    gather: list[list[int]] = []
    scatter: list[int] = []
    start = 0
    for row, count in enumerate(query_lens):
        gather.append([start + min(q, count - 1) for q in range(width)])
        scatter.extend(row * width + q for q in range(count))
        start += count
    return (
        torch.tensor(gather, dtype=torch.int64, device=device),
        torch.tensor(scatter, dtype=torch.int64, device=device),
    )
