"""The paged-attention backend on CPUs: the PyTorch backend with prefill chunks attended by the
compiled kernel that reads the paged cache in place (`kernels.paged_attention_cpu`); decode rows,
sinks and windows that exclude keys stay on the twin's path."""

from __future__ import annotations

from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.kernels.paged_attention_cpu import paged_attention_cpu


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu-paged"
    attend = staticmethod(paged_attention_cpu)
