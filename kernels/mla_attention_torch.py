"""PyTorch twins of the multi-head latent attention (MLA, DeepSeek-V2/V3) kernels over a paged
latent cache: the reference a faster kernel is tested against, and the CPU implementation.

The cache holds, per token, the normalised compressed key/value `c` [L] (`kv_lora_rank`) and the
rotated shared rope key `k_pe` [R]. Head h's key is `[W_uk[h] c, k_pe]` and its value
`W_uv[h] c`, where `kv_b` [H, N + V, L] stacks W_uk [H, N, L] over W_uv [H, V, L]. Two ways to
attend, equal up to rounding:
- expanded (prefill): project every context latent to per-head keys and values, then ordinary
  attention; the work grows with context x heads x (N + V) once per chunk;
- absorbed (decode): fold W_uk into the query (`q_nope W_uk[h]`, [L]), score the latents
  directly, and project the latent-space output by W_uv; one query reads only L + R numbers per
  context token, whatever the number of heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.latent_quant import RowFormat, read_rows, store_rows


def store_latent(
    latent: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv: RowFormat | None = None,
) -> None:
    """Write latent [T, L + R] into cache [blocks, block_size, L + R] at `slot_mapping` [T]
    (with `kv`, a quantized cache [blocks, block_size, bytes]: `kernels.latent_quant`)."""
    store_rows(latent, cache, slot_mapping, kv)


def expanded_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latents: torch.Tensor,
    kv_b: torch.Tensor,
    scale: float,
    fp32: bool = False,
) -> torch.Tensor:
    """Causal attention of one sequence's last Q positions, keys and values expanded per head.

    q_nope [Q, H, N], q_pe [Q, H, R], latents [S, L + R] (the whole context, the queries' own
    tokens last), kv_b [H, N + V, L]; returns [Q, H, V]. `fp32` computes in float32."""
    dtype = q_nope.dtype
    if fp32:
        q_nope, q_pe, latents, kv_b = q_nope.float(), q_pe.float(), latents.float(), kv_b.float()
    num_heads, rows, rank = kv_b.shape
    nope = q_nope.shape[-1]
    q_len, seq_len = q_nope.shape[0], latents.shape[0]
    c, k_pe = latents[:, :rank], latents[:, rank:]
    kv = F.linear(c, kv_b.reshape(num_heads * rows, rank)).view(seq_len, num_heads, rows)
    keys = torch.cat((kv[..., :nope], k_pe.unsqueeze(1).expand(-1, num_heads, -1)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, Q, N + R]
    k = keys.transpose(0, 1).unsqueeze(0)  # [1, H, S, N + R]
    v = kv[..., nope:].transpose(0, 1).unsqueeze(0)  # [1, H, S, V]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Queries are the last q_len positions: query i sees keys 0 .. seq_len - q_len + i.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos  # [Q, S]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1).to(dtype)  # [Q, H, V]


def absorbed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latents: torch.Tensor,
    kv_b: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in latent space for a padded batch of rows.

    q_nope [B, H, Q, N], q_pe [B, H, Q, R], latents [B, S, L + R], kv_b [H, N + V, L], mask
    [B, 1, Q, S] bool (None: every query sees every latent); returns [B, H, Q, V]."""
    rank = kv_b.shape[-1]
    batch, heads, q_len, nope = q_nope.shape
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [H, N, L], [H, V, L]
    q_latent = torch.einsum("bhqn,hnl->bhql", q_nope, w_uk)
    query = torch.cat((q_latent, q_pe), dim=-1)  # [B, H, Q, L + R]
    # One key head serves every query head: fold the heads into the query rows, [B, H * Q, C],
    # and score each row against the latents once. (PyTorch's CPU SDPA with `enable_gqa`
    # expands the keys per head: 100x slower at 16 heads and 4K tokens, measured.)
    rows = query.reshape(batch, heads * q_len, -1)
    scores = torch.matmul(rows, latents.transpose(1, 2))  # [B, H * Q, S]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if mask is not None:
        scores = scores.view(batch, heads, q_len, -1).masked_fill(~mask, float("-inf"))
        scores = scores.view(batch, heads * q_len, -1)
    probs = scores.softmax(dim=-1).to(latents.dtype)
    o = torch.matmul(probs, latents[..., :rank]).view(batch, heads, q_len, rank)  # [B, H, Q, L]
    return torch.einsum("bhql,hvl->bhqv", o, w_uv)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    kv_b: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    kv: RowFormat | None = None,
) -> torch.Tensor:
    """Causal MLA of the step's queries q_nope [T, H, N], q_pe [T, H, R] over each sequence's
    cached latents (this step's included): decode rows absorbed, prefill chunks expanded.
    `kv`: the cache's row format where it is quantized. Returns [T, H, V]."""
    num_tokens, num_heads = q_nope.shape[0], q_nope.shape[1]
    out = q_nope.new_empty(num_tokens, num_heads, kv_b.shape[1] - q_nope.shape[-1])
    starts = metadata.query_start_loc_host
    num_decodes = metadata.num_decodes
    if num_decodes:
        decoded = starts[num_decodes]  # decode query rows (verify rows have several)
        rows = (q_nope[:decoded], q_pe[:decoded])
        out[:decoded] = _decode(*rows, cache, kv_b, metadata, scale, kv)
    expanded_prefill_rows(q_nope, q_pe, cache, kv_b, metadata, scale, out, kv)
    return out


def expanded_prefill_rows(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    kv_b: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor,
    kv: RowFormat | None = None,
) -> None:
    """The prefill chunks of the step (rows `num_decodes ..`), expanded, into `out` [T, H, V]."""
    block_size = cache.shape[1]
    starts = metadata.query_start_loc_host
    for row in range(metadata.num_decodes, metadata.num_seqs):
        begin, end = starts[row], starts[row + 1]
        seq_len = metadata.seq_lens_host[row]
        table = metadata.block_tables[row, : -(-seq_len // block_size)]
        gathered = torch.index_select(cache, 0, table).flatten(0, 1)[:seq_len]
        latents = read_rows(gathered, kv, q_nope.dtype)  # [S, L + R]
        out[begin:end] = expanded_attention(
            q_nope[begin:end],
            q_pe[begin:end],
            latents,
            kv_b,
            scale,
            metadata.prefill_softmax_fp32,
        )


def _decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    kv_b: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    kv: RowFormat | None,
) -> torch.Tensor:
    """Decode rows, batched: one query each, or a verify row's few (padded to the longest)."""
    slots = metadata.decode_slots
    assert slots is not None, "decode rows need decode_slots"
    num_rows, max_len = slots.shape
    width = cache.shape[-1]
    gathered = cache.view(-1, width).index_select(0, slots.view(-1)).view(num_rows, max_len, width)
    latents = read_rows(gathered, kv, q_nope.dtype)
    index = metadata.decode_query_index
    if index is None:
        o = absorbed_attention(
            q_nope.unsqueeze(2), q_pe.unsqueeze(2), latents, kv_b, scale, metadata.decode_mask
        )  # [B, H, 1, V]
        return o.squeeze(2)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T_dec, H, D] -> [B, H, Q_max, D]
        rows = x.index_select(0, index.view(-1)).view(num_rows, -1, x.shape[1], x.shape[2])
        return rows.transpose(1, 2)

    o = absorbed_attention(
        padded(q_nope), padded(q_pe), latents, kv_b, scale, metadata.decode_mask
    )  # [B, H, Q_max, V]
    o = o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])  # [B * Q_max, H, V]
    assert metadata.decode_output_index is not None
    return o.index_select(0, metadata.decode_output_index)  # [T_dec, H, V]
