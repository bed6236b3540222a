"""Greedy parity with transformers on the real default checkpoint (SmolLM2-135M-Instruct)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from tests.engine.parity import hf_greedy, max_logit_difference

NEW_TOKENS = 64
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Explain its history briefly."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers and say why they are prime."},
    ],
    [{"role": "user", "content": "Write a haiku about paged attention."}],
]


@pytest.fixture(scope="module")
def default_checkpoint() -> Path:
    from dgpp.appliance.default_model import install_default

    return install_default()  # idempotent: returns at once when already installed


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_checkpoint: Path) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(default_checkpoint), dtype=torch.float32
    ).eval()
    llm = LLM(str(default_checkpoint), prefill_chunk_tokens=16, block_size=8, kv_capacity=4096)
    prompts = [llm.render_chat(conversation) for conversation in CONVERSATIONS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    worst = 0.0
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == expected
        worst = max(worst, max_logit_difference(llm, hf_model, prompt, expected[:16]))
    print(f"SmolLM2-135M-Instruct: max |logit difference| = {worst:.2e}")
    assert worst < 5e-3
    assert "Paris" in outputs[0].outputs[0].text
