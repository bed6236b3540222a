"""Quantized safetensors checkpoints served packed: for tiny random-weight Llama/Qwen3 models
quantized in the test to GPTQ, AWQ, AutoRound, compressed-tensors (int4, FP8, NVFP4, MXFP4),
the `fp8` block method and ModelOpt NVFP4, each module's packed weight dequantizes to the
format's reference bit for bit, and dgpp's greedy tokens equal transformers' on those reference
weights (float32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.errors import ConfigError, ModelLoadError
from dgpp.engine.quant.checkpoint_formats import packed_module
from tests.conftest import tiny_model
from tests.engine.parity import hf_greedy
from tests.engine.quant import quant_build as qb

PROMPTS = [[1, 504, 3458, 314, 253, 2018, 28], list(range(600, 630))]
STEPS = 8
WIDE = {"hidden_size": 128, "intermediate_size": 256}


def _ct(args: dict[str, object], fmt: str) -> tuple[qb.Quantizer, dict[str, object]]:
    config_args = {
        k: (str(v).replace("torch.", "") if k == "scale_dtype" else v) for k, v in args.items()
    }
    config = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": config_args}},
        "ignore": ["lm_head"],
    }
    return qb.compressed(args, fmt), config


def _gptq(
    group: int, act_order: bool = False, **extra: object
) -> tuple[qb.Quantizer, dict[str, object]]:
    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order}
    return qb.gptq(group, act_order), {**config, **extra}


CASES: dict[str, tuple[str, dict[str, object], tuple[qb.Quantizer, dict[str, object]]]] = {
    "gptq-g32": ("LlamaForCausalLM", {}, _gptq(32, sym=False)),
    "gptq-g64-act-order": ("Qwen3ForCausalLM", {}, _gptq(64, True)),
    "gptq-g128": ("LlamaForCausalLM", WIDE, _gptq(128)),
    "autoround-gptq": (
        "Qwen3ForCausalLM",
        {},
        (
            qb.gptq(32),
            {
                "quant_method": "auto-round",
                "bits": 4,
                "group_size": 32,
                "sym": True,
                "packing_format": "auto_round:auto_gptq",
                "data_type": "int",
            },
        ),
    ),
    "awq-g32": (
        "LlamaForCausalLM",
        {},
        (
            qb.awq(32),
            {
                "quant_method": "awq",
                "bits": 4,
                "group_size": 32,
                "version": "gemm",
                "zero_point": True,
            },
        ),
    ),
    "autoround-awq": (
        "Qwen2ForCausalLM",
        {},
        (
            qb.awq(64),
            {
                "quant_method": "auto-round",
                "bits": 4,
                "group_size": 64,
                "packing_format": "auto_round:auto_awq",
            },
        ),
    ),
    "ct-w4a16-g32": (
        "Qwen3ForCausalLM",
        {},
        _ct(
            {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
            },
            "pack-quantized",
        ),
    ),
    "ct-w4a16-asym-channel": (
        "LlamaForCausalLM",
        {},
        _ct(
            {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel"},
            "pack-quantized",
        ),
    ),
    "fp8-block": (
        "Qwen3ForCausalLM",
        {},
        (
            qb.fp8_block((16, 32)),
            {
                "quant_method": "fp8",
                "weight_block_size": [16, 32],
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
            },
        ),
    ),
    "ct-fp8-channel": (
        "LlamaForCausalLM",
        {},
        _ct(
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            "float-quantized",
        ),
    ),
    "ct-fp8-tensor": (
        "Qwen3ForCausalLM",
        {},
        _ct(
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
            "float-quantized",
        ),
    ),
    "ct-nvfp4": (
        "Qwen3ForCausalLM",
        {},
        _ct(
            {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "tensor_group",
                "group_size": 16,
            },
            "nvfp4-pack-quantized",
        ),
    ),
    "modelopt-nvfp4": (
        "LlamaForCausalLM",
        {},
        (
            qb.nvfp4_modelopt(),
            {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
        ),
    ),
    "ct-mxfp4": (
        "LlamaForCausalLM",
        {},
        _ct(
            {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "scale_dtype": torch.uint8,
            },
            "mxfp4-pack-quantized",
        ),
    ),
}


def _build(
    case: str, out: Path, tokenizer_dir: Path
) -> tuple[Path, torch.nn.Module, dict[str, torch.Tensor]]:
    architecture, overrides, (quantizer, config) = CASES[case]
    model = tiny_model(architecture, 0, **overrides)
    reference = qb.write_quantized(model, out, quantizer, config)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    return out, model, reference


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_matches_transformers(
    case: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    path, model, reference = _build(case, tmp_path / case, tokenizer_dir)
    schemes = ModelConfig.from_checkpoint(path).quant_schemes
    assert len(schemes.items) == 7 * model.config.num_hidden_layers, schemes.describe()
    # Every module's packed weight is the format's reference, bit for bit.
    tensors = load_file(str(path / "model.safetensors"))
    for module, scheme in schemes.items:
        parts = {suffix: tensors[f"{module}.{suffix}"] for suffix in scheme.suffixes}
        dense = packed_module(module, scheme, parts).dense()
        assert torch.equal(dense, reference[f"{module}.weight"]), module

    model.load_state_dict(reference)
    expected = [hf_greedy(model.eval(), prompt, STEPS) for prompt in PROMPTS]
    llm = LLM(str(path), kv_capacity=256, block_size=8, prefill_chunk_tokens=16)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8, "the layer should keep its weight packed"
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert [list(out.outputs[0].token_ids) for out in outputs] == expected


def test_unsupported_methods_are_refused_by_name(tmp_path: Path, tokenizer_dir: Path) -> None:
    path, _, _ = _build("gptq-g32", tmp_path / "q", tokenizer_dir)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    for quant, message in [
        (
            {"quant_method": "bitsandbytes"},
            "'bitsandbytes' is not supported; supported: gguf, gptq",
        ),
        ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "8-bit weights is not supported"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
        ({"quant_method": "compressed-tensors", "format": "marlin-24"}, "format 'marlin-24'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}},
            },
            "group 'g' has 8-bit int weights",
        ),
        ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo 'W4A8_AWQ'"),
    ]:
        config_file.write_text(json.dumps({**config, "quantization_config": quant}))
        with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
            LLM(str(path), kv_capacity=256)


def test_a_configured_quantization_must_match_the_checkpoint(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    path, _, _ = _build("fp8-block", tmp_path / "q", tokenizer_dir)
    with pytest.raises(ModelLoadError, match=r"asks for quantization 'gptq'.*stored as 'fp8'"):
        LLM(str(path), kv_capacity=256, quantization="gptq")
    # an unknown method is refused by the knob itself, before the checkpoint is opened
    with pytest.raises(ConfigError, match=r"quantization must be one of auto, none, .*'int3'"):
        LLM(str(path), kv_capacity=256, quantization="int3")
    assert LLM(str(path), kv_capacity=256, quantization="fp8").engine.model_config.quant_schemes


def test_missing_and_inconsistent_tensors_name_the_module(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    path, _, _ = _build("awq-g32", tmp_path / "q", tokenizer_dir)
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    module = "model.layers.1.mlp.down_proj"
    broken = dict(tensors)
    broken[f"{module}.scales"] = broken[f"{module}.scales"][:, :8].contiguous()
    save_file(broken, str(weights))
    with pytest.raises(ModelLoadError, match=f"quantized module {module}"):
        LLM(str(path), kv_capacity=256)
    del tensors[f"{module}.qzeros"]
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match=f"{module} lacks qzeros"):
        LLM(str(path), kv_capacity=256)


def test_split_layers_stay_packed_only_at_group_boundaries() -> None:
    from dataclasses import replace

    from dgpp.engine.quant.quant_schemes import LayerScheme, QuantSchemes

    scheme = LayerScheme("gptq", "uint4", 32, "float16", ("qweight", "qzeros", "scales"), True)
    schemes = QuantSchemes("gptq", (("a", scheme), ("b", scheme)))
    assert schemes.group_format(["a", "b"], 64) == scheme.group_format(64)
    assert schemes.group_format(["a"], 64, 64, 128) == scheme.group_format(64)
    assert schemes.group_format(["a"], 48, 16, 64) is None  # the cut goes through a group
    assert schemes.group_format(["a", "c"], 64) is None  # fused with an unquantized module
    ordered = QuantSchemes("gptq", (("a", replace(scheme, act_order=True)),))
    assert ordered.group_format(["a"], 128) is not None
    assert ordered.group_format(["a"], 64, 0, 128) is None  # act order on a split input
    channel = QuantSchemes("fp8", (("a", replace(scheme, group_size=0)),))
    fmt = channel.group_format(["a"], 48, 48, 96)
    assert fmt is not None and fmt.group_size == 48  # one scale per row fits any split


def test_quantization_is_described_from_the_config() -> None:
    from dgpp.engine.quant.quant_schemes import describe_quantization

    def described(quant: dict[str, object] | None) -> str:
        return describe_quantization({} if quant is None else {"quantization_config": quant})

    assert described(None) == "none"
    assert described({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}) == (
        "GPTQ int4 g128 act-order"
    )
    assert described({"quant_method": "awq", "bits": 4, "group_size": 64}) == "AWQ int4 g64"
    assert described({"quant_method": "fp8", "weight_block_size": [128, 128]}) == (
        "FP8 block 128x128"
    )
    assert described({"quant_method": "modelopt_fp4"}) == "ModelOpt NVFP4"
    ct = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {"type": "float", "num_bits": 4, "group_size": 16}}},
    }
    assert described(ct) == "compressed-tensors float4 g16"
    gguf = {"quant_method": "gguf", "weight_formats": {"a": "Q4_K", "b": "Q4_K", "c": "Q6_K"}}
    assert described(gguf) == "GGUF Q4_K (+Q6_K)"
