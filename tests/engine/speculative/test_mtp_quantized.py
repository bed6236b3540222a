"""MTP layers of FP8 checkpoints (the form the releases ship: GLM-4.5-Air-FP8, DeepSeek-V3,
Qwen3-Next-80B-A3B-FP8 quantize the MTP layer like the decoder layers, with 128x128 block
scales): the layer loads its linears packed, its drafts verified by the FP8 target leave the
output plain decoding's, and the memory plan counts its packed bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.layers.linear import PackableLinear
from tests.conftest import build_tiny_checkpoint
from tests.engine.quant.quant_build import quantize_fp8_in_place
from tests.engine.speculative.mtp_checkpoint import (
    ARCH,
    MOE,
    QWEN_FAMILIES,
    with_mtp_layer,
    with_qwen_mtp_layer,
)
from tests.engine.speculative.mtp_checks import check_mtp_memory_plan

BLOCK = (16, 32)
PROMPTS = [[5, 17, 99, 3, 42], list(range(100, 137))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KNOBS = dict(kv_capacity=512, block_size=8, prefill_chunk_tokens=16)


def quantize_fp8(checkpoint: Path) -> int:
    """Every projection whose shape the blocks divide, FP8 with block scales, in place (the
    rest, like the releases' routers, norms and narrow projections, stays float); how many."""
    return quantize_fp8_in_place(checkpoint, BLOCK, lambda name: name.endswith("_proj.weight"))


@pytest.fixture(scope="module", params=["deepseek-v3", "qwen3-next"])
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, request: pytest.FixtureRequest
) -> Path:
    out = tmp_path_factory.mktemp(f"{request.param}-fp8-mtp")
    if request.param == "deepseek-v3":
        path = build_tiny_checkpoint(out, tokenizer_dir, ARCH, num_nextn_predict_layers=1, **MOE)
        with_mtp_layer(path)
    else:
        architecture, overrides, *_ = QWEN_FAMILIES[request.param]
        path = build_tiny_checkpoint(out, tokenizer_dir, architecture, **overrides)
        with_qwen_mtp_layer(path, request.param)
    assert quantize_fp8(path) > 10
    return path


def test_fp8_mtp_layer_is_packed_and_changes_nothing(checkpoint: Path) -> None:
    plain = LLM(str(checkpoint), **KNOBS)
    expected = [tuple(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, GREEDY)]
    llm = LLM(str(checkpoint), speculative="mtp", **KNOBS)
    got = [tuple(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    assert got == expected
    engine, runner = llm.engine, llm.engine.runner
    assert runner.mtp is not None and engine.counters.spec_decode.drafts > 0
    linears = [m for m in runner.mtp.layer.modules() if isinstance(m, PackableLinear)]
    packed = [m for m in linears if m.weight.dtype in (torch.uint8, torch.float8_e4m3fn)]
    assert len(packed) >= 3, "the MTP layer's FP8 projections should stay packed"
    check_mtp_memory_plan(checkpoint, **KNOBS)  # packed bytes, byte for byte
