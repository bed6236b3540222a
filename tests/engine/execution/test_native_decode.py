"""The fused native decode step (kernels/cpu/decoder_step.cpp) against its twin, the PyTorch
layer path, on the same weights: greedy tokens equal and logits within float32 summation order,
for each family it covers (Llama, Qwen2's q/k/v biases, Qwen3's q/k norms), batches below and
above the tile GEMM's row count, contexts long enough to split attention into spans, and every
weight kind it reads (GGML blocks: tests/engine/quant/test_gguf_parity.py serves them through
it against transformers; dense float32 here, bfloat16 and float16 below)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.execution import native_decode
from dgpp.kernels import decoder_step_cpu
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import engines_logit_difference

pytestmark = pytest.mark.skipif(
    decoder_step_cpu.cpu_extension() is None, reason="no C++ toolchain for the native step"
)

CASES = [
    ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    ("LlamaForCausalLM", {"num_key_value_heads": 1}),
    ("Qwen2ForCausalLM", {}),
    ("Qwen3ForCausalLM", {"num_key_value_heads": 4}),
]


def _llms(checkpoint: Path) -> tuple[LLM, LLM]:
    common = dict(block_size=4, prefill_chunk_tokens=16, kv_capacity=4096, seed=0)
    native = LLM(str(checkpoint), native_decode=True, **common)
    twin = LLM(str(checkpoint), native_decode=False, **common)
    assert native.engine.runner.native is not None and twin.engine.runner.native is None
    return native, twin


@pytest.mark.parametrize(("architecture", "overrides"), CASES, ids=lambda v: str(v)[:30])
def test_native_step_equals_the_layer_path(
    tmp_path: Path, tokenizer_dir: Path, architecture: str, overrides: dict
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture, **overrides)
    native, twin = _llms(checkpoint)
    generator = torch.Generator().manual_seed(3)
    # 1-token prompts decode from position 0; 18 rows pass the tile GEMM's 16; 300 positions
    # split each KV head's keys into spans
    lengths = [1, 2, 5, 9, 13, 17, 21, 40, 3, 7, 11, 19, 23, 29, 31, 37, 41, 300]
    prompts = [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for batch in (prompts[-1:], prompts[:3], prompts):
        got = [o.outputs[0].token_ids for o in native.generate(batch, params)]
        want = [o.outputs[0].token_ids for o in twin.generate(batch, params)]
        assert got == want, f"a batch of {len(batch)}"
    prompt, forced = prompts[-1], prompts[7][:12]
    worst = engines_logit_difference(native, twin, prompt, forced)
    assert worst < 1e-4, worst
    assert native.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_weights(tmp_path: Path, tokenizer_dir: Path, dtype: torch.dtype) -> None:
    """Dense 16-bit weights read as stored equal float32 weights of the same values (the layer
    path on the rounded weights is the reference)."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "Qwen2ForCausalLM")
    runner = LLM(str(checkpoint), block_size=4, kv_capacity=256).engine.runner
    linears = native_decode.covered_linears(runner.model)
    for linear in linears:
        linear.weight.data = linear.weight.data.to(dtype).float()
    layout = BatchLayout((BatchRow(0, 1, (0,)), BatchRow(0, 1, (1,))), 2, 4, False)
    ids, positions = torch.tensor([5, 900]), torch.tensor([0, 0])
    metadata = {b.name: b.prepare(layout) for b in runner.backends}
    with torch.inference_mode():
        want = runner.model(ids, positions, metadata)
    for linear in linears:
        linear.weight.data = linear.weight.data.to(dtype)  # what the step reads
    got = native_decode.NativeDecode(runner.model).forward(ids, positions, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_twin_where_it_does_not_apply(
    tmp_path: Path, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    moe = build_tiny_checkpoint(tmp_path / "moe", tokenizer_dir, "Qwen3MoeForCausalLM")
    with caplog.at_level(logging.INFO, logger="dgpp.engine.execution.native_decode"):
        llm = LLM(str(moe), kv_capacity=256)
    assert llm.engine.runner.native is None
    assert "decode runs the PyTorch layer path: attention DecoderAttention, MLP" in caplog.text
    model = llm.engine.runner.model
    assert "world of several ranks" in native_decode.why_not(
        model, torch.device("cpu"), torch.float32, 2, 16
    )
    assert "float32 activations" in native_decode.why_not(
        model, torch.device("cpu"), torch.bfloat16, 1, 16
    )


def test_unbuilt_kernel_serves_on_the_twin(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    monkeypatch.setattr(decoder_step_cpu, "cpu_extension", lambda: None)
    llm = LLM(str(checkpoint), kv_capacity=256)
    assert llm.engine.runner.native is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_kernel_refuses_bad_inputs(tmp_path: Path, tokenizer_dir: Path) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    llm = LLM(str(checkpoint), kv_capacity=256)
    step = llm.engine.runner.native.step
    hidden = torch.zeros(1, llm.engine.runner.model.config.hidden_size)
    head_dim = llm.engine.runner.model.config.head_dim
    cos = sin = torch.ones(1, head_dim)
    one = torch.tensor([1])
    with pytest.raises(RuntimeError, match="positions"):  # more positions than its table holds
        step.forward(hidden, cos, sin, one, torch.tensor([[0]]), torch.tensor([4096]))
    with pytest.raises(RuntimeError, match="outside the cache"):  # a block past the pool
        step.forward(hidden, cos, sin, one, torch.tensor([[10**9]]), one)
    with pytest.raises(RuntimeError, match="outside the cache"):
        step.forward(hidden, cos, sin, torch.tensor([-1]), torch.tensor([[0]]), one)
    with pytest.raises(RuntimeError, match="float32"):
        step.forward(hidden.double(), cos, sin, one, torch.tensor([[0]]), one)
    with pytest.raises(RuntimeError, match="cos/sin"):
        step.forward(hidden, cos[:, :4], sin, one, torch.tensor([[0]]), one)


def test_sixteen_bit_checkpoint_keeps_its_weights(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A bfloat16 checkpoint served in float32 on CPU: its layers keep bfloat16 weights (half
    the bytes a token reads), prefill widens them per product, and the tokens equal the float32
    expansion's (the native step off)."""
    from tests.conftest import tiny_model

    model = tiny_model("LlamaForCausalLM").to(torch.bfloat16)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    native, twin = _llms(tmp_path)
    linears = native_decode.covered_linears(native.engine.runner.model)
    assert {linear.weight.dtype for linear in linears} == {torch.bfloat16}
    prompts = [list(range(100, 140)), [7], list(range(900, 913))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in twin.generate(prompts, params)]
