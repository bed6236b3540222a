"""Helpers that compare dgpp with transformers on the same checkpoint."""

from __future__ import annotations

import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.request import Request
from dgpp.engine.scheduler import ScheduledChunk, StepPlan


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy decoding (argmax with its KV cache, as `generate` does), running past
    EOS like dgpp's `ignore_eos`; `generate` itself cannot ignore EOS without masking its logits."""
    tokens: list[int] = []
    past = None
    step_ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            result = hf_model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            tokens.append(token)
            step_ids = torch.tensor([[token]])
    return tokens


def max_logit_difference(
    llm: LLM, hf_model: torch.nn.Module, prompt: list[int], continuation: list[int]
) -> float:
    """Teacher-force `prompt + continuation` through dgpp (prompt in prefill chunks, then one decode
    row per token, all through the paged cache) and return the largest absolute difference from
    transformers' logits at every position dgpp samples from."""
    engine = llm.engine
    sequence = prompt + continuation
    with torch.inference_mode():
        reference = hf_model(torch.tensor([sequence])).logits[0].float()  # [S, V]
    request = Request("parity", list(prompt), SamplingParams(max_tokens=1), max_tokens=1)
    chunk_size = engine.config.prefill_chunk_tokens
    worst = 0.0
    try:
        while request.num_pending_tokens:
            num = min(request.num_pending_tokens, chunk_size)
            assert engine.block_manager.allocate_slots(request, num)
            chunk = ScheduledChunk(request, request.num_computed_tokens, num)
            logits = engine.runner.run(StepPlan((chunk,), num_decodes=int(num == 1)))
            request.num_computed_tokens += num
            if chunk.is_sampling:
                position = request.num_tokens - 1
                vocab = reference.shape[-1]
                diff = (logits[0, :vocab] - reference[position]).abs().max().item()
                worst = max(worst, diff)
                if request.num_tokens == len(sequence):
                    break
                request.token_ids.append(sequence[request.num_tokens])
    finally:
        engine.block_manager.free(request)
    return worst
