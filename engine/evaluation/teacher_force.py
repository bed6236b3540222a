"""Teacher-forced logits: a known sequence through the engine's own steps (the prompt in
prefill chunks, then one decode row per token, all through the paged cache), for comparing
dgpp's logits with a reference model's at every position it samples from."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dgpp.engine.engine import LLMEngine
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import PromptIds, Request
from dgpp.engine.scheduling.scheduler import ScheduledChunk, StepPlan
from dgpp.engine.vision.spans import chunk_end


def teacher_forced_logits(
    engine: LLMEngine, prompt: list[int], continuation: list[int]
) -> Iterator[tuple[int, torch.Tensor]]:
    """(position, float32 logits [padded_vocab]) at every position the engine samples from
    while `prompt + continuation` is forced through it: the prompt's last, then each forced
    token's. A prompt with images (`PromptIds`) brings them, in chunks that split none. Runs on
    an idle engine; the request's blocks are freed when the iteration ends."""
    sequence = list(prompt) + list(continuation)
    images = prompt.images if isinstance(prompt, PromptIds) else ()
    params = SamplingParams(max_tokens=1)
    request = Request("teacher-forced", list(prompt), params, max_tokens=1, images=images)
    chunk_size = engine.config.prefill_chunk_tokens
    try:
        while request.num_pending_tokens:
            start = request.num_computed_tokens
            end = start + min(request.num_pending_tokens, chunk_size)
            num = chunk_end(request.image_spans, start, end) - start  # never splits an image
            assert engine.block_manager.allocate_slots(request, num)
            chunk = ScheduledChunk(request, request.num_computed_tokens, num)
            # inference mode around the step only, never across a `yield`: a generator suspended
            # inside the block leaves the mode on in its caller, and two interleaved (zipped)
            # generators restored it out of order, leaving it on for good
            with torch.inference_mode():
                logits = engine.runner.run(StepPlan((chunk,), num_decodes=int(num == 1)))
            request.num_computed_tokens += num
            if not chunk.is_sampling:
                continue
            yield request.num_tokens - 1, logits[0].float()
            if request.num_tokens == len(sequence):
                return
            request.token_ids.append(sequence[request.num_tokens])
    finally:
        engine.block_manager.free(request)
