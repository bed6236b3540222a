"""The Triton paged-attention backend (CUDA): the PyTorch backend's cache layout and store,
attention by `kernels.paged_attention_triton`, which reads every row of the step straight from
the paged cache through its block table. Its metadata is tensors only (no host values read in
the forward), so a decode step through it can be captured in a CUDA graph
(`dgpp.engine.execution.decode_graphs`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from dgpp.engine.backends.base import BatchLayout
from dgpp.engine.backends.torch_paged import TorchPagedAttention, paged_metadata
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.dispatch import ROPE_STORE, kernel_on
from dgpp.kernels.paged_attention_triton import paged_attention_triton
from dgpp.kernels.paged_prefill_triton import prefill_tile_starts
from dgpp.kernels.rope_store_torch import rope_store
from dgpp.kernels.rope_store_triton import rope_store_triton


class TritonPagedAttention(TorchPagedAttention):
    name = "triton-paged"
    attend = staticmethod(paged_attention_triton)
    rotate_and_store = staticmethod(rope_store_triton)
    fuses_rope = True  # full-rotary layers pass their angles: rotated in the store, one pass
    graph_safe = True  # the forward reads its metadata's tensors only

    def __init__(self, device: torch.device, kv_dtype: str = "auto") -> None:
        super().__init__(device, kv_dtype)
        if not kernel_on(ROPE_STORE):  # the self-check switched the fused store off
            self.rotate_and_store = rope_store

    def prepare(self, layout: BatchLayout) -> PagedAttentionMetadata:
        """The shared paged metadata, each query token's row and position and the prefill
        tiles' first tokens, built once per step; no PyTorch decode gather inputs."""
        rows: list[int] = []
        positions: list[int] = []
        for index, row in enumerate(layout.rows):
            rows.extend([index] * row.num_tokens)
            positions.extend(range(row.start, row.seq_len))
        device = self.device
        metadata = paged_metadata(layout, device)
        tiles = prefill_tile_starts(metadata.query_start_loc_host, layout.num_decodes)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return replace(
            metadata,
            token_rows=tensor(rows),
            token_positions=tensor(positions),
            prefill_tile_starts=tensor(tiles) if tiles else None,
        )
