"""FP8 block-scaled DeepSeek-V3.2 and GLM-5 checkpoints (the releases' form: e4m3 weights with
float32 `weight_scale_inv` per 128x128 block, here 16x32): the routed and shared experts and
dense MLPs stay packed, the latent-attention and indexer projections (`wq_b`, `wk` included)
are dequantized at load, and the greedy tokens equal transformers' on the dequantized
weights, with contexts past the sparse budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM
from dgpp.engine.layers.linear import PackableLinear
from tests.conftest import build_tiny_checkpoint
from tests.engine.models.test_deepseek_v3 import MOE, _hf, _params, _prompts
from tests.engine.models.test_sparse_attention import SHARED
from tests.engine.parity import hf_greedy
from tests.engine.quant.quant_build import quantize_fp8_in_place

BLOCK = (16, 32)
QUANTIZED = ("_proj.weight", ".indexer.wq_b.weight", ".indexer.wk.weight")


def _quantize(checkpoint: Path, reference: Path) -> int:
    """Quantize `checkpoint` in place (the projections, the indexers' `wq_b` and `wk`, not their
    `weights_proj`: the releases keep it float); the dequantized weights as `reference`."""

    def wanted(name: str) -> bool:
        return name.endswith(QUANTIZED) and "weights_proj" not in name

    return quantize_fp8_in_place(checkpoint, BLOCK, wanted, reference)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        pytest.param("DeepseekV32ForCausalLM", MOE, id="deepseek-v3.2"),
        pytest.param("GlmMoeDsaForCausalLM", {**MOE, **SHARED}, id="glm-5"),
    ],
)
def test_fp8_checkpoints_match_transformers_on_their_dequantized_weights(
    tmp_path: Path, tokenizer_dir: Path, arch: str, overrides: dict[str, object]
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path / "fp8", tokenizer_dir, arch, **overrides)
    count = _quantize(checkpoint, tmp_path / "reference")
    assert count > 20
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=1024, seed=0)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackableLinear)]
    fp8 = (torch.uint8, torch.float8_e4m3fn)
    packed = [m for m in linears if m.weight is not None and m.weight.dtype in fp8]
    assert len(packed) >= 30, "the FP8 experts and MLPs should stay packed"
    hf_model = _hf(tmp_path / "reference")
    prompts = _prompts()[2:]  # 13, 40 and 70 tokens: two past the budget of 24
    outputs = llm.generate(prompts, _params(12))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 12)
