"""`prefill_precision=fp32` keeps prefill attention and logits in float32 under bf16 weights."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import Request
from dgpp.engine.scheduling.scheduler import ScheduledChunk, StepPlan
from tests.conftest import build_tiny_checkpoint


def _prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    engine = llm.engine
    request = Request("p", list(prompt), SamplingParams(max_tokens=1), max_tokens=1)
    assert engine.block_manager.allocate_slots(request, len(prompt))
    try:
        plan = StepPlan((ScheduledChunk(request, 0, len(prompt)),), num_decodes=0)
        return engine.runner.run(plan)[0, : engine.model_config.vocab_size]
    finally:
        engine.block_manager.free(request)


def test_fp32_prefill_is_closer_to_the_float32_reference(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    prompt = torch.randint(3, 40000, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = hf(torch.tensor([prompt])).logits[0, -1]
    errors = {}
    for precision in ("fp32", "model"):
        llm = LLM(str(checkpoint), dtype="bfloat16", prefill_precision=precision, kv_capacity=512)
        logits = _prefill_logits(llm, prompt)
        assert logits.dtype == torch.float32
        errors[precision] = (logits - reference).abs().max().item()
    print(errors)
    assert errors["fp32"] < errors["model"], errors
