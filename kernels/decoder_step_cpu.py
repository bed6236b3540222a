"""The fused decode step of a Llama-family decoder on CPUs (kernels/cpu/decoder_step.cpp): every
layer of a batch of decode rows in one native call, over GGML blocks (Q4_0, Q4_1, Q8_0) or dense
float32, bfloat16 and float16 weights and the paged KV cache read in place.

Its PyTorch twin is the model's own layer path (`dgpp.engine.models.llama`), which runs every
step this does not take; `dgpp.engine.execution.native_decode` chooses between them once per model
and device. Where the kernel cannot be built, the twin serves, said once.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from dgpp.kernels.cpu_build import PORTABLE_FLAGS, load_cpu_extension
from dgpp.kernels.ggml_blocks import FORMATS

SOURCE = Path(__file__).with_name("cpu") / "decoder_step.cpp"
# Dense weight kinds by dtype (GGML's type ids, as the GGML formats' own)
DENSE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
GGML_KINDS = frozenset({"Q4_0", "Q4_1", "Q8_0"})

log = logging.getLogger(__name__)


@cache
def cpu_extension() -> ModuleType | None:
    """The compiled step, built on first use; None (logged once) when it cannot be."""
    return load_cpu_extension(
        SOURCE, "step", "fused CPU decode step", log, "decode runs the PyTorch layer path"
    )


@cache
def portable_extension() -> ModuleType | None:
    """The step built for the baseline instruction set: the paths a CPU without AVX2 runs (Arm's
    are these with NEON vectors), for the tests to hold against the twin on any machine."""
    return load_cpu_extension(
        SOURCE, "step_portable", "portable CPU decode step", log, "none", PORTABLE_FLAGS
    )


def weight_kind(weight: torch.Tensor, weight_format: str | None) -> int | None:
    """The kernel's kind for a linear layer's weight (a GGML type id), or None when it does not
    read it: GGML blocks it decodes, or dense float32 / bfloat16 / float16 rows."""
    if weight_format is None:
        return DENSE_KINDS.get(weight.dtype)
    return FORMATS[weight_format].ggml_type if weight_format in GGML_KINDS else None


def new_step(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    eps: float,
    scale: float,
) -> object:
    """An empty step for a decoder of these shapes; `add_layer` each layer in order."""
    ext = cpu_extension()
    assert ext is not None, "check cpu_extension() first"
    return ext.DecoderStep(
        hidden, heads, kv_heads, head_dim, intermediate, eps, scale, int(ext.tile_rows())
    )
