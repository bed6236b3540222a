"""Chooses the attention backend once per model, device and dtype, when the model runner is
built."""

from __future__ import annotations

import torch

from dgpp.engine.backends.base import AttentionBackend, PagedAttentionBackend
from dgpp.engine.backends.cpu_paged import CpuPagedAttention
from dgpp.engine.backends.encoder import EncoderAttentionBackend
from dgpp.engine.backends.mla_base import MLABackend
from dgpp.engine.backends.sparse_mla import SparseMLAAttention
from dgpp.engine.backends.sparse_paged import SparsePagedAttention
from dgpp.engine.backends.torch_mla import TorchMLAAttention
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.kernels.dispatch import MLA_DECODE, PAGED_ATTENTION, has_triton, kernel_on


def select_attention_backend(
    device: torch.device, dtype: torch.dtype, kv_dtype: str = "auto"
) -> PagedAttentionBackend:
    """The paged-attention backend for `device` and `dtype`: the Triton kernel on CUDA (where
    Triton is installed and the start-up self-check kept it); on CPUs the PyTorch twin with
    float32 prefill chunks read in place by the compiled kernel (which falls back to the twin,
    said once, where it cannot be built); the twin elsewhere. Every dtype the engine serves
    runs on each."""
    if device.type == "cuda" and has_triton() and kernel_on(PAGED_ATTENTION):
        from dgpp.engine.backends.triton_paged import TritonPagedAttention  # imports triton

        return TritonPagedAttention(device, kv_dtype)
    if device.type == "cpu" and dtype == torch.float32:
        return CpuPagedAttention(device, kv_dtype)
    return TorchPagedAttention(device, kv_dtype)


def select_mla_backend(
    device: torch.device, dtype: torch.dtype, kv_dtype: str = "auto"
) -> MLABackend:
    """The multi-head latent attention backend: the Triton decode kernel on CUDA (where Triton
    is installed and the self-check kept it), the PyTorch one elsewhere; latents at
    `kv_dtype`."""
    del dtype
    if device.type == "cuda" and has_triton() and kernel_on(MLA_DECODE):
        from dgpp.engine.backends.triton_mla import TritonMLAAttention  # imports triton

        return TritonMLAAttention(device, kv_dtype)
    return TorchMLAAttention(device, kv_dtype)


def select_backend_for(
    model: ModelConfig, device: torch.device, dtype: torch.dtype, kv_dtype: str = "auto"
) -> AttentionBackend:
    """The backend of the model's attention kind: MLA for checkpoints whose attention keeps a
    compressed key/value latent (DeepSeek-V3), sparse MLA over it where an indexer picks each
    query's keys (DeepSeek-V3.2, GLM-5), paged attention otherwise, sparse where an indexer
    picks each query's blocks (Qwen4-Exp). A quantized `kv_dtype` is for paged keys and
    values (`kernels.kv_quant`), latents and indexer keys (`kernels.latent_quant`); the memory
    plan refuses it for the others."""
    if model.is_encoder:
        return EncoderAttentionBackend(device)
    if model.is_latent_attention and model.raw.get("index_topk") is not None:
        return SparseMLAAttention(select_mla_backend(device, dtype, kv_dtype))
    if model.is_latent_attention:
        return select_mla_backend(device, dtype, kv_dtype)
    if model.raw.get("indexer_budget") is not None:
        return SparsePagedAttention(select_attention_backend(device, dtype, kv_dtype))
    return select_attention_backend(device, dtype, kv_dtype)
