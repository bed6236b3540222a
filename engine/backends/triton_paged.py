"""The Triton paged-attention backend (CUDA): the PyTorch backend's metadata, cache layout and
store, attention by `kernels.paged_attention_triton`, which reads every row of the step straight
from the paged cache through its block table."""

from __future__ import annotations

from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.kernels.paged_attention_triton import paged_attention_triton


class TritonPagedAttention(TorchPagedAttention):
    name = "triton-paged"
    attend = staticmethod(paged_attention_triton)
