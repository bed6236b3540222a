"""The PyTorch paged-attention backend: the reference every faster backend is tested against,
and the one used where no faster kernel exists (CPU)."""

from __future__ import annotations

from dataclasses import replace

import torch

from dgpp.engine.backends.base import BatchLayout
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.decode_inputs import DecodeWindows, decode_gather_inputs, decode_query_index
from dgpp.kernels.kv_quant import kv_format
from dgpp.kernels.kv_rotation import rotate, rotation
from dgpp.kernels.paged_attention_torch import paged_attention, store_kv
from dgpp.kernels.rope_store_torch import apply_rotary, rope_store


def paged_metadata(layout: BatchLayout, device: torch.device) -> PagedAttentionMetadata:
    """What every paged backend needs of a step: each new token's cache slot, the rows' block
    tables (padded with block 0), where each row's queries start, and each row's length."""
    block_size = layout.block_size
    slots: list[int] = []
    query_start = [0]
    for row in layout.rows:
        table = row.block_table
        span = range(row.start, row.seq_len)
        slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in span)
        query_start.append(query_start[-1] + row.num_tokens)
    seq_lens = [row.seq_len for row in layout.rows]
    max_blocks = max(len(row.block_table) for row in layout.rows)
    tables = [[*row.block_table, *[0] * (max_blocks - len(row.block_table))] for row in layout.rows]

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return PagedAttentionMetadata(
        slot_mapping=tensor(slots),
        block_tables=tensor(tables),
        query_start_loc=tensor(query_start),
        seq_lens=tensor(seq_lens),
        query_start_loc_host=tuple(query_start),
        seq_lens_host=tuple(seq_lens),
        num_decodes=layout.num_decodes,
        max_seq_len=max(seq_lens),
        prefill_softmax_fp32=layout.prefill_softmax_fp32,
    )


class TorchPagedAttention:
    name = "torch-paged"
    # The attention over the paged cache (after this step's keys and values are stored): the
    # PyTorch twin here; a faster backend names its kernel of the same signature.
    attend = staticmethod(paged_attention)
    # Rotary with the key's store, for layers that pass their angles (`fuses_rope` backends).
    rotate_and_store = staticmethod(rope_store)
    fuses_rope = False  # layers rotate themselves: one rotation of the adjacent q/k heads

    def __init__(self, device: torch.device, kv_dtype: str = "auto") -> None:
        self.device = device
        self.kv_dtype = kv_dtype  # how the caches store keys and values (`kernels.kv_quant`)

    def prepare(self, layout: BatchLayout) -> PagedAttentionMetadata:
        """The step's slots, block tables and row extents, plus what the PyTorch decode path
        gathers by: every decode row's context slots and padding mask (and sliding windows')."""
        metadata = paged_metadata(layout, self.device)
        if not layout.num_decodes:
            return metadata
        decodes = layout.rows[: layout.num_decodes]
        query_lens = [row.num_tokens for row in decodes]
        decode_tables = [list(row.block_table) for row in decodes]
        decode_lens = list(metadata.seq_lens_host[: layout.num_decodes])
        device, block_size = self.device, layout.block_size
        decode_slots, decode_mask = decode_gather_inputs(
            decode_tables, decode_lens, block_size, device, query_lens
        )
        query_index = decode_query_index(query_lens, device)
        return replace(
            metadata,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            decode_query_index=query_index[0] if query_index else None,
            decode_output_index=query_index[1] if query_index else None,
            # Sliding-window layers' slots and masks: built by the first layer of each window.
            decode_windows=DecodeWindows(
                decode_tables, decode_lens, query_lens, block_size, device
            ),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        scale: float,
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
        angles: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`kv_scales` [2]: the checkpoint's static key and value scales (fp8_e4m3 uses them)."""
        key_cache, value_cache = cache[0], cache[1]
        slots = metadata.slot_mapping
        kv = kv_format(self.kv_dtype, key.shape[-1])
        if kv is not None:  # the twins quantize the rows they store; the kernel reads them
            values = None
            fixed = kv_scales if kv.name == "fp8_e4m3" else None
            if angles is not None and (kv.name == "int4" or fixed is not None):
                query, key, angles = apply_rotary(query, angles), apply_rotary(key, angles), None
            if kv.name == "int4":  # rotated after RoPE, turned back after (`kernels.kv_rotation`)
                keys = rotation(key.shape[-1], key.device, key.dtype)
                values = rotation(value.shape[-1], value.device, value.dtype)
                query, key, value = rotate(query, keys), rotate(key, keys), rotate(value, values)
            if angles is not None:
                query = rope_store(query, key, value, angles, key_cache, value_cache, slots, kv)
            else:
                store_kv(key, value, key_cache, value_cache, slots, kv, fixed)
            out = self.attend(
                query, key_cache, value_cache, metadata, scale, sinks, sliding_window, kv=kv
            )
            return rotate(out, values)
        if angles is None:
            store_kv(key, value, key_cache, value_cache, slots)
        else:
            query = self.rotate_and_store(query, key, value, angles, key_cache, value_cache, slots)
        return self.attend(query, key_cache, value_cache, metadata, scale, sinks, sliding_window)
