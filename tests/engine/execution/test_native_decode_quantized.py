"""The fused native CPU decode step over an int8 or fp8 KV cache (`kv_cache_dtype`): it stores
each head as the twin's rows (`kernels.kv_quant`: Q8_0 blocks, or a scale and e4m3 codes) and
reads them in place, so its decode steps give the PyTorch layer path's log-probabilities over
the same quantized cache, to float32 summation order; int4 caches are left to the layer path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM
from dgpp.engine.scheduling.request import PromptIds
from tests.conftest import build_tiny_checkpoint
from tests.engine.family_parity import forced_logprobs


def _engine(checkpoint: Path, native: bool, kv: str) -> LLM:
    return LLM(
        str(checkpoint), dtype="float32", kv_capacity=512, block_size=16, native_decode=native,
        kv_cache_dtype=kv, prefix_cache=False,
    )  # fmt: skip


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_the_native_step_reads_and_writes_quantized_rows_as_the_layer_path(
    tmp_path: Path, tokenizer_dir: Path, kv: str
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "Qwen3ForCausalLM", head_dim=32)
    native = _engine(checkpoint, True, kv)
    assert native.engine.runner.native is not None, f"the native step serves {kv} caches"
    assert _engine(checkpoint, True, "int4").engine.runner.native is None
    layers = _engine(checkpoint, False, kv)
    assert layers.engine.runner.native is None
    gen = torch.Generator().manual_seed(8)
    prompt = PromptIds(torch.randint(3, 49000, (40,), generator=gen).tolist())
    forced = torch.randint(3, 49000, (24,), generator=gen).tolist()  # 24 native decode steps
    native.engine.runner.native.step.phase_seconds()  # zeroed
    got = forced_logprobs(native, prompt, forced, chunk=40)
    assert native.engine.runner.native.step.phase_seconds()[2] > 0  # its attention ran
    want = forced_logprobs(layers, prompt, forced, chunk=40)
    assert float((got - want).abs().max()) < 1e-4
