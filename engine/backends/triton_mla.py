"""The Triton multi-head latent attention backend (CUDA): decode and verify rows absorbed in
latent space by `kernels.mla_decode_triton` (q_nope folded through W_uk before, the output
projected by W_uv after), prefill chunks expanded per head as in the PyTorch backend. Its
metadata is the Triton paged backend's, tensors only, so a decode step through it can be
captured in a CUDA graph."""

from __future__ import annotations

import torch

from dgpp.engine.backends.base import BatchLayout
from dgpp.engine.backends.triton_paged import TritonPagedAttention
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.latent_quant import row_format
from dgpp.kernels.mla_attention_torch import expanded_prefill_rows, store_latent
from dgpp.kernels.mla_decode_triton import mla_decode_triton


class TritonMLAAttention:
    name = "triton-mla"
    graph_safe = True  # decode-only steps read their metadata's tensors only
    decode = staticmethod(mla_decode_triton)  # latent-space decode over the paged cache

    def __init__(self, device: torch.device, kv_dtype: str = "auto") -> None:
        self._paged = TritonPagedAttention(device)
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
        nope = q_nope.shape[-1]
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], kv_b.shape[1] - nope)
        decoded = metadata.query_start_loc_host[metadata.num_decodes]
        if decoded:
            w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [H, N, L], [H, V, L]
            q_latent = torch.einsum("thn,hnl->thl", q_nope[:decoded], w_uk)
            latent_out = self.decode(
                q_latent, q_pe[:decoded].contiguous(), cache, metadata, scale, kv
            )  # [T_dec, H, L]
            out[:decoded] = torch.einsum("thl,hvl->thv", latent_out, w_uv)
        expanded_prefill_rows(q_nope, q_pe, cache, kv_b, metadata, scale, out, kv)
        return out
