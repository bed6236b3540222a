"""The fused decode step built for the baseline instruction set (`portable_extension`: what a CPU
without AVX2 runs, and Arm's path with NEON vectors in place of SSE) against its twin, the PyTorch
layer path, on every weight kind it reads: GGML blocks through the generic block decoder, dense
float32 and 16-bit rows through the generic vector conversions. No Arm machine is at hand; this
is the same C++ without the x86 intrinsics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.kernels import decoder_step_cpu
from tests.conftest import tiny_model
from tests.engine.parity import engines_logit_difference
from tests.engine.quant.gguf_build import write_gguf

PROMPTS = [[1, 504, 3458, 314, 253, 2018, 28], list(range(600, 640)), [7]]


@pytest.fixture(scope="module")
def portable() -> object:
    if decoder_step_cpu.cpu_extension() is None:
        pytest.skip("no C++ toolchain for the native step")
    ext = decoder_step_cpu.portable_extension()
    assert ext is not None, "the native step builds, so its portable build must"
    assert ext is not decoder_step_cpu.cpu_extension()
    return ext


@pytest.fixture(autouse=True)
def _views_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield


@pytest.mark.parametrize("weight_format", ["Q4_1", "Q4_0", "Q8_0", "F32", "F16", "BF16"])
def test_the_portable_step_equals_the_layer_path(
    tmp_path: Path,
    tokenizer_gguf: Path,
    portable: object,
    monkeypatch: pytest.MonkeyPatch,
    weight_format: str,
) -> None:
    model = tiny_model("LlamaForCausalLM", 0, vocab_size=4096, num_key_value_heads=2)
    path = write_gguf(
        model, "LlamaForCausalLM", tmp_path / "tiny.gguf", weight_format, tokenizer_gguf
    )
    common = dict(kv_capacity=512, block_size=4, seed=0)
    twin = LLM(str(path), native_decode=False, **common)
    monkeypatch.setattr(decoder_step_cpu, "cpu_extension", lambda: portable)
    native = LLM(str(path), native_decode=True, **common)
    assert type(native.engine.runner.native.step).__module__ == portable.__name__
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in native.generate(PROMPTS, params)]
    assert got == [o.outputs[0].token_ids for o in twin.generate(PROMPTS, params)]
    prompt, forced = PROMPTS[1], PROMPTS[0]
    worst = engines_logit_difference(native, twin, prompt, forced)
    assert worst < 1e-4, worst
