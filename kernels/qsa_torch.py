"""PyTorch twins of Qwen4-Exp's query-sparse attention (QSA) over a paged KV cache: the
indexer's block selection and attention that reads only the selected tokens' keys and values.

The indexer keeps one raw key [D] per token (its own paged cache). A query at position p sees
the complete blocks of `ratio` consecutive tokens before it (block b: tokens b*ratio ..
(b+1)*ratio - 1, all <= p); each block's key is the mean of its raw keys, normalised and
roped at the block's first position (`finish`, the model's). A block scores
`sum_h relu(q[h] . key) / sqrt(D)`; the query keeps its top `budget / ratio` blocks plus the
tail of an incomplete block (the last p + 1 mod ratio tokens): at most budget + ratio - 1
tokens. A row whose every query keeps all its blocks selects everything; the caller runs it
dense. Blocks tied at the cut go to the earliest (`topk_ties`), whatever the row's length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.kv_quant import KvFormat
from dgpp.kernels.latent_quant import RowFormat, read_rows
from dgpp.kernels.sparse_mla_torch import TILE_ELEMENTS, TokenSelection, token_selection
from dgpp.kernels.topk_ties import topk_earliest

# pooled block keys [B, D] and their first positions [B] -> the keys the queries score
BlockKeys = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def selection_width(budget: int, ratio: int) -> int:
    """Tokens a query may select: `budget` from whole blocks, up to ratio - 1 of a tail."""
    return budget + ratio - 1


def needs_selection(seq_len: int, budget: int, ratio: int) -> bool:
    """Whether a row of `seq_len` tokens has more complete blocks than its queries keep."""
    return seq_len // ratio > budget // ratio


def select_blocks(
    q: torch.Tensor,
    cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    budget: int,
    ratio: int,
    block_keys: BlockKeys,
    kv: RowFormat | None = None,
) -> TokenSelection:
    """Each query token's selected positions: q [T, Hi, D] (normalised, roped), cache
    [blocks, block_size, D] the raw indexer keys (this step's stored; with `kv`, quantized
    rows)."""
    num_tokens, _, dim = q.shape
    device = q.device
    width, keep = selection_width(budget, ratio), budget // ratio
    block_size = cache.shape[1]
    positions = torch.empty(num_tokens, width, dtype=torch.int64, device=device)
    starts = metadata.query_start_loc_host
    flat = cache.view(-1, cache.shape[-1])
    within = torch.arange(ratio, device=device)
    for row, seq_len in enumerate(metadata.seq_lens_host):
        begin, end = starts[row], starts[row + 1]
        if end == begin:
            continue
        if not needs_selection(seq_len, budget, ratio):
            positions[begin:end] = torch.arange(width, device=device)
            continue
        blocks = seq_len // ratio
        table = metadata.block_tables[row, : -(-seq_len // block_size)]
        slots = table.unsqueeze(1) * block_size + torch.arange(block_size, device=device)
        raw = read_rows(flat.index_select(0, slots.view(-1)[: blocks * ratio]), kv, q.dtype)
        raw = raw.view(blocks, ratio, dim)
        first_positions = torch.arange(blocks, device=device) * ratio
        keys = block_keys(raw.float().mean(dim=1).to(raw.dtype), first_positions).float()
        first = seq_len - (end - begin)
        step = max(1, TILE_ELEMENTS // max(1, q.shape[1] * blocks))
        for at in range(begin, end, step):
            upto = min(end, at + step)
            scores = torch.einsum("qhd,bd->qhb", q[at:upto].float(), keys).relu_().sum(dim=1)
            query_pos = torch.arange(at - begin + first, upto - begin + first, device=device)
            complete = (query_pos + 1) // ratio  # complete blocks each query sees
            visible = first_positions.unsqueeze(0) // ratio < complete.unsqueeze(1)
            scores.masked_fill_(~visible, float("-inf"))
            chosen = topk_earliest(scores, keep)  # [q, keep] block ids, ties to the earliest
            chosen = torch.where(visible.gather(1, chosen), chosen, blocks + seq_len)  # invalid
            tokens = (chosen.unsqueeze(-1) * ratio + within).flatten(1)  # [q, budget]
            tail = (complete * ratio).unsqueeze(1) + within[: ratio - 1]  # [q, ratio - 1]
            positions[at:upto] = torch.cat((tokens, tail), dim=1)
    return token_selection(positions, metadata, block_size)


def sparse_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    selection: TokenSelection,
    scale: float,
    kv: KvFormat | None = None,
) -> torch.Tensor:
    """Each query's attention over its selected tokens only: query [T, H, D], caches
    [blocks, block_size, H_kv, D] (grouped-query heads; with `kv`, quantized rows of its width);
    returns [T, H, D]. Softmax in float32 (or wider)."""
    num_tokens, num_heads, dim = query.shape
    kv_heads, stored = key_cache.shape[2], key_cache.shape[3]
    group = num_heads // kv_heads
    keys_flat = key_cache.view(-1, kv_heads, stored)
    values_flat = value_cache.view(-1, kv_heads, stored)
    out = torch.empty_like(query)
    width = selection.slots.shape[1]
    step = min(num_tokens, max(1, TILE_ELEMENTS // max(1, width * max(kv_heads * dim, num_heads))))
    # Gather buffers reused by every tile (a fresh one costs its page faults: sparse_mla_torch).
    key_buffer = keys_flat.new_empty(step * width, kv_heads, stored)
    value_buffer = values_flat.new_empty(step * width, kv_heads, stored)
    for at in range(0, num_tokens, step):
        upto = min(num_tokens, at + step)
        slots = selection.slots[at:upto].reshape(-1)
        keys = torch.index_select(keys_flat, 0, slots, out=key_buffer[: slots.shape[0]])
        values = torch.index_select(values_flat, 0, slots, out=value_buffer[: slots.shape[0]])
        keys = read_rows(keys, kv, query.dtype).view(upto - at, width, kv_heads, dim)
        values = read_rows(values, kv, query.dtype).view(upto - at, width, kv_heads, dim)
        q = query[at:upto].view(upto - at, kv_heads, group, dim)
        scores = torch.einsum("tkgd,tskd->tkgs", q, keys)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
        valid = selection.valid[at:upto].view(upto - at, 1, 1, width)
        scores = scores.masked_fill(~valid, float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        out[at:upto] = torch.einsum("tkgs,tskd->tkgd", probs, values).reshape(-1, num_heads, dim)
    return out
