"""DeepSeek-V4 as released: FP8 attention and shared experts with E8M0 block scales (`scale`),
FP4 routed experts. dgpp keeps the query and output projections, the shared experts and the
routed experts packed, and serves the tokens transformers gives on the same weights
dequantized; world 2 splits the packed experts' 32-column blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.layers.linear import PackableLinear
from dgpp.engine.layers.v4_experts import Fp4Experts
from dgpp.engine.planning.weight_count import rank_weight_bytes
from tests.conftest import build_tiny_checkpoint
from tests.engine.models.test_deepseek_v4 import TINY, _prompts
from tests.engine.models.v4_release import fp4_rows, fp8_blocks, write_release
from tests.engine.parity import hf_greedy, max_logit_difference

# Experts 64 wide: each of two ranks holds 32 columns, one FP4 scale block.
RELEASE = {**TINY, "moe_intermediate_size": 64, "intermediate_size": 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("deepseek-v4-release")
    source = build_tiny_checkpoint(
        root / "float", tokenizer_dir, "DeepseekV4ForCausalLM", **RELEASE
    )
    write_release(source, root / "quantized", root / "reference")
    return root / "quantized", root / "reference"


def test_the_writers_round_trip() -> None:
    """The test's own FP8 and FP4 writers: their dequantized weights are what they encode."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    codes, scale, values = fp8_blocks(weight, 16)
    assert scale.shape == (2, 4) and codes.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(values, weight, rtol=0.07, atol=1e-3)
    packed, scale, values = fp4_rows(weight)
    assert packed.shape == (32, 32) and scale.shape == (32, 2)
    assert (values - weight).abs().max() < scale.float().max() * 1.01


def test_the_release_serves_transformers_tokens(checkpoints: tuple[Path, Path]) -> None:
    quantized, reference = checkpoints
    hf_model = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
    llm = LLM(str(quantized), block_size=4, prefill_chunk_tokens=11, kv_capacity=1024, seed=0)
    model = llm.engine.runner.model
    attention = model.model.layers[1].self_attn
    assert isinstance(model.model.layers[1].mlp.experts, Fp4Experts)
    packed = [attention.q_b_proj, attention.output.o_b_proj]
    assert all(isinstance(layer, PackableLinear) and layer.weight_format for layer in packed)
    prompts = _prompts()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 10)
    prompt = prompts[3]
    worst = max_logit_difference(llm, hf_model, prompt, hf_greedy(hf_model, prompt, 4))
    assert worst < 1e-3, worst


def test_world_of_two_equals_world_of_one(checkpoints: tuple[Path, Path]) -> None:
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    _check_world_of_two(checkpoints[0], KNOBS)


def test_the_packed_weights_are_counted_packed(checkpoints: tuple[Path, Path]) -> None:
    """The memory plan counts FP4 experts at half a byte a weight (plus a bfloat16 scale per
    32), not at the dtype's two bytes."""
    quantized, reference = (ModelConfig.from_checkpoint(path) for path in checkpoints)
    packed, dense = (rank_weight_bytes(config, 1, 0, 2) for config in (quantized, reference))
    experts = 4 * 8 * 3 * 64 * 64  # layers x experts x projections x weights
    saved = experts * 2 - experts * (0.5 + 2 / 32)
    assert dense - packed >= saved
