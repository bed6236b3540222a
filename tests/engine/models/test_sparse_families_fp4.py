"""4-bit releases of the sparse families: ModelOpt NVFP4 (e2m1 pairs, e4m3 scales per 16,
a float32 global scale) over the attention projections and MLPs of a tiny DeepSeek-V3.2 and
Qwen4-Exp load packed through the quantization layer, and the greedy tokens equal
transformers' on the format's reference weights, with contexts past the sparse budget. (The
Qwen4-Exp export writes its n-gram table whole, `ngram_embedding.weight`: read as one shard.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.layers.linear import PackableLinear
from tests.conftest import tiny_model
from tests.engine.models.test_deepseek_v3 import MOE
from tests.engine.parity import hf_greedy
from tests.engine.quant import quant_build as qb

NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
PROMPTS = [list(range(600, 613)), list(range(1000, 1040))]  # the second past both budgets


def _per_expert_names(weights: Path) -> None:
    """transformers' stacked experts (gate_up [E, 2I, H], down [E, H, I]) under the per-expert
    names DeepSeek releases use (dgpp reads stacked experts for the Qwen families only)."""
    tensors = load_file(str(weights))
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_up_proj")]:
        stem = name.removesuffix(".gate_up_proj")
        gate_up, down = tensors.pop(name), tensors.pop(f"{stem}.down_proj")
        width = gate_up.shape[1] // 2
        for expert in range(gate_up.shape[0]):
            tensors[f"{stem}.{expert}.gate_proj.weight"] = gate_up[expert, :width].contiguous()
            tensors[f"{stem}.{expert}.up_proj.weight"] = gate_up[expert, width:].contiguous()
            tensors[f"{stem}.{expert}.down_proj.weight"] = down[expert].contiguous()
    save_file(tensors, str(weights), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        pytest.param("DeepseekV32ForCausalLM", MOE, id="deepseek-v3.2"),
        pytest.param("Qwen4ExpForCausalLM", {}, id="qwen4-exp"),
    ],
)
def test_nvfp4_checkpoints_match_transformers(
    tmp_path: Path, tokenizer_dir: Path, arch: str, overrides: dict[str, object]
) -> None:
    model = tiny_model(arch, 0, **overrides)
    reference = qb.write_quantized(model, tmp_path, qb.nvfp4_modelopt(), NVFP4)
    if arch.startswith("Deepseek"):
        _per_expert_names(tmp_path / "model.safetensors")
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, tmp_path / item.name)
    model.load_state_dict(reference)
    expected = [hf_greedy(model.eval(), prompt, 10) for prompt in PROMPTS]
    llm = LLM(str(tmp_path), kv_capacity=512, block_size=4, prefill_chunk_tokens=16)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackableLinear)]
    packed = [m for m in linears if m.weight is not None and m.weight.dtype == torch.uint8]
    assert len(packed) >= 4, "the NVFP4 projections should stay packed"
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params)]
    assert got == expected
