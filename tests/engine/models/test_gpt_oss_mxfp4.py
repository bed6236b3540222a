"""gpt-oss with its experts in MXFP4, the released checkpoints' layout (`*_blocks` [E, rows,
groups, 16] e2m1 codes, `*_scales` [E, rows, groups] E8M0): kept packed, dequantized bit for
bit as transformers' reference does, and greedy tokens equal transformers' on those weights at
world 1 and world 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.layers.mxfp4_experts import MXFP4, Mxfp4Experts
from dgpp.engine.quant.quant_schemes import describe_quantization
from dgpp.kernels.group_codes import GroupWeight, dequantize_group, pack_nibbles
from tests.conftest import tiny_model
from tests.engine.parity import hf_greedy
from tests.engine.quant.quant_build import _round_e2m1

GPT_OSS = dict(
    num_local_experts=8,
    num_experts_per_tok=2,
    intermediate_size=64,  # 32 columns per rank at world 2: whole MXFP4 blocks
    head_dim=16,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)
QUANT = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
PROMPTS = [[1, 504, 3458, 314, 253, 2018, 28], list(range(600, 640)), [9, 4, 9]]


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] float -> (blocks [E, rows, cols / 32, 16] uint8, scales uint8)."""
    experts, rows, cols = weight.shape
    groups = weight.reshape(experts, rows, cols // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    codes = _round_e2m1(groups / torch.exp2(exponent).unsqueeze(-1))
    blocks = pack_nibbles(codes.reshape(experts, rows, cols)).reshape(experts, rows, -1, 16)
    return blocks, (exponent + 127).to(torch.uint8)


def build(out: Path, tokenizer_dir: Path) -> tuple[Path, torch.nn.Module]:
    """A tiny gpt-oss saved with MXFP4 experts; the model returned holds transformers' own
    dequantization of them (float32)."""
    model = tiny_model("GptOssForCausalLM", **GPT_OSS)
    tensors, reference = {}, {}
    for name, value in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4(value.transpose(1, 2))  # rows: output features
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            reference[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            tensors[name] = value.contiguous()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = QUANT
    (out / "config.json").write_text(json.dumps(config, default=str))
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    model.load_state_dict(reference, strict=False)
    return out, model


def test_mxfp4_codes_dequantize_as_transformers_does() -> None:
    weight = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0))
    blocks, scales = mxfp4(weight)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    for expert in range(3):
        bf16 = torch.exp2(scales[expert].float() - 127).to(torch.bfloat16)
        packed = GroupWeight(blocks[expert].flatten(-2), bf16)
        assert torch.equal(dequantize_group(packed, MXFP4), expected[expert].T)


def test_gpt_oss_mxfp4_experts_stay_packed_and_match_transformers(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    checkpoint, hf_model = build(tmp_path / "gpt-oss-mxfp4", tokenizer_dir)
    assert ModelConfig.from_checkpoint(checkpoint).quant_method == "mxfp4"
    assert describe_quantization(json.loads((checkpoint / "config.json").read_text()))
    expected = [hf_greedy(hf_model.eval(), prompt, 10) for prompt in PROMPTS]
    llm = LLM(str(checkpoint), kv_capacity=512, block_size=4, prefill_chunk_tokens=11)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts, Mxfp4Experts)
    assert experts.gate_up_proj_blocks.dtype == torch.uint8
    assert not hasattr(experts, "gate_up_proj")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_gpt_oss_mxfp4_world_of_two_equals_world_of_one(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    checkpoint, _ = build(tmp_path / "gpt-oss-mxfp4", tokenizer_dir)
    _check_world_of_two(checkpoint, KNOBS)
