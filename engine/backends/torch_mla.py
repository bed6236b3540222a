"""The PyTorch multi-head latent attention backend: the reference for faster MLA backends, and
the one used where no faster kernel exists (CPU)."""

from __future__ import annotations

import torch

from dgpp.engine.backends.base import BatchLayout
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.latent_quant import row_format
from dgpp.kernels.mla_attention_torch import mla_attention, store_latent


class TorchMLAAttention:
    name = "torch-mla"

    def __init__(self, device: torch.device, kv_dtype: str = "auto") -> None:
        # The latent cache is paged by the same slots as a key/value cache, so the step's
        # metadata is the paged backend's (slots, block tables, decode gathers and masks).
        self._paged = TorchPagedAttention(device)
        self.kv_dtype = kv_dtype  # the latent cache's (`MLALatentSpec.row_format`)

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
        kv = row_format(self.kv_dtype, kv_b.shape[-1], q_pe.shape[-1])
        store_latent(latent, cache, metadata.slot_mapping, kv)
        return mla_attention(q_nope, q_pe, cache, kv_b, metadata, scale, kv)
