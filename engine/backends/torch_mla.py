"""The PyTorch multi-head latent attention backend: the reference for faster MLA backends, and
the one used where no faster kernel exists (CPU)."""

from __future__ import annotations

import torch

from dgpp.engine.backends.base import BatchLayout
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.mla_attention_torch import mla_attention, store_latent


class TorchMLAAttention:
    name = "torch-mla"

    def __init__(self, device: torch.device) -> None:
        # The latent cache is paged by the same slots as a key/value cache, so the step's
        # metadata is the paged backend's (slots, block tables, decode gathers and masks).
        self._paged = TorchPagedAttention(device)

    def prepare(self, layout: BatchLayout) -> PagedAttentionMetadata:
        return self._paged.prepare(layout)

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        cache: torch.Tensor,
        kv_b: torch.Tensor,
        metadata: PagedAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_latent(latent, cache, metadata.slot_mapping)
        return mla_attention(q_nope, q_pe, cache, kv_b, metadata, scale)
