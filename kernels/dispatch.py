"""Chooses the kernel implementation once, at engine construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgpp.kernels import paged_attention_torch
from dgpp.kernels.attention_metadata import PagedAttentionMetadata

StoreKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata, float], torch.Tensor
]


@dataclass(frozen=True)
class AttentionKernels:
    name: str
    store_kv: StoreKV
    paged_attention: PagedAttention


def attention_kernels(device: str) -> AttentionKernels:
    """The paged-attention kernels for `device`. Only the PyTorch twins exist so far; Triton
    kernels with the same signatures will be chosen here for CUDA devices."""
    del device
    return AttentionKernels(
        name="torch",
        store_kv=paged_attention_torch.store_kv,
        paged_attention=paged_attention_torch.paged_attention,
    )
