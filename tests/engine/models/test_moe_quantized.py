"""Quantized mixture-of-experts checkpoints (one quantized module per expert, as GPTQ, FP8 and
compressed-tensors producers write them) load with their experts kept packed and generate
transformers' tokens on the dequantized weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.layers.moe import PackedExperts
from tests.conftest import tiny_model
from tests.engine.parity import hf_greedy
from tests.engine.quant import quant_build as qb
from tests.engine.quant.test_quant_parity import CASES

GLM = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    head_dim=16,
    attention_bias=True,
)
FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory stacked experts as the per-expert tensors checkpoints hold."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        found = FUSED.match(name)
        if found is None:
            out[name] = value
            continue
        stem, kind = found.groups()
        for expert, weight in enumerate(value):
            if kind == "down_proj":
                out[f"{stem}.{expert}.down_proj.weight"] = weight
            else:
                gate, up = weight.chunk(2, dim=0)
                out[f"{stem}.{expert}.gate_proj.weight"] = gate
                out[f"{stem}.{expert}.up_proj.weight"] = up
    return out


def _fused(reference: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Per-expert dequantized weights back in transformers' stacked layout."""
    state = {}
    for name in model.state_dict():
        found = FUSED.match(name)
        if found is None:
            state[name] = reference[name]
            continue
        stem, kind = found.groups()
        count = model.config.n_routed_experts
        if kind == "down_proj":
            parts = [reference[f"{stem}.{e}.down_proj.weight"] for e in range(count)]
        else:
            parts = [
                torch.cat(
                    (
                        reference[f"{stem}.{e}.gate_proj.weight"],
                        reference[f"{stem}.{e}.up_proj.weight"],
                    )
                )
                for e in range(count)
            ]
        state[name] = torch.stack(parts)
    return state


@pytest.mark.parametrize("case", ["gptq-g32", "fp8-block"])
def test_quantized_experts_stay_packed_and_match_transformers(
    tmp_path: Path, tokenizer_dir: Path, case: str
) -> None:
    quantizer, quant_config = CASES[case][2]
    model = tiny_model("Glm4MoeForCausalLM", **GLM)
    generator = torch.Generator().manual_seed(0)
    tensors, reference = {}, {}
    for name, value in _per_expert(dict(model.state_dict())).items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and module.split(".")[-1] in qb.LINEARS:
            packed, dequantized = quantizer(module, value.float(), generator)
            tensors.update({f"{module}.{key}": t.contiguous() for key, t in packed.items()})
            reference[name] = dequantized
        else:
            tensors[name] = reference[name] = value.contiguous()
    out = tmp_path / case
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config, default=str))
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)

    model.load_state_dict(_fused(reference, model))
    prompts = [[1, 504, 3458, 314, 253, 2018, 28], list(range(600, 630))]
    expected = [hf_greedy(model.eval(), prompt, 8) for prompt in prompts]
    llm = LLM(str(out), kv_capacity=256, block_size=8, prefill_chunk_tokens=16)
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert isinstance(experts, PackedExperts)
    assert experts.get_submodule("3").gate_up_proj.weight.dtype == torch.uint8
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
