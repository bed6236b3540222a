"""Chooses the attention backend once per device and dtype, when the model runner is built."""

from __future__ import annotations

import torch

from dgpp.engine.backends.base import PagedAttentionBackend
from dgpp.engine.backends.torch_paged import TorchPagedAttention


def select_attention_backend(device: torch.device, dtype: torch.dtype) -> PagedAttentionBackend:
    """The paged-attention backend for `device` and `dtype`: the PyTorch one on every device
    today (it is the only one there is)."""
    del dtype  # every dtype the engine serves runs on the PyTorch backend
    return TorchPagedAttention(device)
