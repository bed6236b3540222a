"""Greedy parity with transformers on the real default checkpoint (SmolLM2-135M-Instruct, as
installed: its Q4_1 GGUF served packed; transformers dequantizes the same file with gguf-py),
and the perplexity of a fixed text at Q4_1 against dgpp on the float32 expansion of the same
weights."""

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
    from dgpp.appliance.models.default import install_default

    return install_default()  # idempotent: returns at once when already installed


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_checkpoint: Path) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(default_checkpoint), gguf_file="model.gguf", dtype=torch.float32
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


TEXT = (
    "Paged attention stores the key and value cache of every request in fixed-size blocks, so "
    "memory is allocated as a sequence grows instead of reserved for its longest possible "
    "length. A block table maps each request's logical positions to physical blocks, and "
    "blocks that hold the same prompt prefix can be shared between requests. The scheduler "
    "admits new requests while free blocks remain and preempts the newest ones when the pool "
    "runs out, recomputing their cache later. Continuous batching adds and removes requests at "
    "every step, so the batch stays full while some requests finish early."
)


def _perplexity(llm: LLM, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of every token after the first, each position's
    logits taken through the paged cache one decode step at a time."""
    from dgpp.engine.scheduling.request import Request
    from dgpp.engine.scheduling.scheduler import ScheduledChunk, StepPlan

    engine = llm.engine
    request = Request("ppl", token_ids[:1], SamplingParams(max_tokens=1), max_tokens=1)
    total = 0.0
    try:
        with torch.inference_mode():
            for position in range(1, len(token_ids)):
                assert engine.block_manager.allocate_slots(request, 1)
                chunk = ScheduledChunk(request, request.num_computed_tokens, 1)
                logits = engine.runner.run(StepPlan((chunk,), num_decodes=1))
                request.num_computed_tokens += 1
                vocab = engine.model_config.vocab_size
                log_probs = torch.log_softmax(logits[0, :vocab].double(), dim=-1)
                total -= float(log_probs[token_ids[position]])
                request.token_ids.append(token_ids[position])
    finally:
        engine.block_manager.free(request)
    return float(torch.exp(torch.tensor(total / (len(token_ids) - 1))))


@pytest.fixture(scope="module")
def expanded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's float32 expansion (what `install-default --dtype float32` writes)."""
    from dgpp.appliance.models.default import _write_float32, ensure_default_gguf

    out = tmp_path_factory.mktemp("float32")
    _write_float32(ensure_default_gguf(), out)
    return out


@pytest.mark.slow
def test_prompt_logprobs_of_the_float32_expansion_equal_transformers(expanded: Path) -> None:
    """Issue 44's target on real weights: every prompt token's logprob and the best two within
    1e-4 of transformers' float32 log-softmax, in 24-token chunks."""
    hf_model = AutoModelForCausalLM.from_pretrained(str(expanded), dtype=torch.float32).eval()
    llm = LLM(str(expanded), kv_capacity=1024, prefill_chunk_tokens=24)
    token_ids = llm.tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    scored = llm.generate([token_ids], params)[0].prompt_logprobs
    with torch.inference_mode():
        want = hf_model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)
    assert scored is not None and scored[0] is None and len(scored) == len(token_ids)
    worst = 0.0
    for position in range(1, len(token_ids)):
        entry, row = scored[position], want[position - 1]
        assert entry is not None and entry.token_id == token_ids[position]
        worst = max(worst, abs(entry.logprob - row[token_ids[position]].item()))
        for token, value in entry.top:
            worst = max(worst, abs(value - row[token].item()))
    print(f"{len(token_ids)} prompt tokens: max |logprob difference| = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.slow
def test_q4_1_perplexity_matches_the_float32_expansion(
    default_checkpoint: Path, expanded: Path
) -> None:
    packed = LLM(str(default_checkpoint), kv_capacity=1024)
    assert packed.engine.model_config.weight_formats, "the default model should serve at Q4_1"
    token_ids = packed.tokenizer.encode(TEXT)
    dense = LLM(str(expanded), kv_capacity=1024)
    assert not dense.engine.model_config.weight_formats
    q4_1, float32 = _perplexity(packed, token_ids), _perplexity(dense, token_ids)
    print(f"perplexity over {len(token_ids)} tokens: Q4_1 packed {q4_1:.4f}, float32 {float32:.4f}")
    assert abs(q4_1 / float32 - 1) < 0.005
