"""Greedy token-for-token parity with transformers on tiny random models of each architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import hf_greedy, max_logit_difference

NEW_TOKENS = 24
CASES = [
    ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    ("LlamaForCausalLM", {"tie_word_embeddings": False, "num_key_value_heads": 1}),
    ("Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    ("Qwen3ForCausalLM", {"tie_word_embeddings": False}),
    ("Qwen3ForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    (
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    (
        "Qwen2ForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
]


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    lengths = [1, 5, 13, 40, 70]
    return [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize(("architecture", "overrides"), CASES, ids=lambda v: str(v)[:40])
def test_greedy_tokens_match_transformers(
    tmp_path: Path, tokenizer_dir: Path, architecture: str, overrides: dict
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    # Small chunks and blocks so prefill chunks and block boundaries fall mid-prompt.
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)  # one batch: prompts of mixed lengths together
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == expected, f"prompt of {len(prompt)} tokens"
        assert output.outputs[0].finish_reason == "length"
    worst = max(
        max_logit_difference(llm, hf_model, prompt, hf_greedy(hf_model, prompt, 8))
        for prompt in prompts[1:4]
    )
    print(f"{architecture} {overrides}: max |logit difference| = {worst:.2e}")
    assert worst < 1e-3
    assert llm.engine.block_manager.num_used_blocks == 0


def test_generated_tokens_are_not_degenerate(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Guards the parity test itself: the tiny models must produce varied tokens, or equal
    outputs would prove little."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    llm = LLM(str(checkpoint), kv_capacity=1024)
    output = llm.generate(
        [list(range(100, 140))], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    assert len(set(output[0].outputs[0].token_ids)) > 8
