"""One parity harness for every family dgpp serves: what users' workloads do, against
transformers on the same weights (issue 62).

Each family's tiny config makes every sparse or windowed path really drop tokens (budgets,
windows and compression rates far below the prompt); a vision-language family's prompt holds
two images of different, non-square grids, so its M-RoPE positions run behind the sequence
index from the first image on. On one engine per family:

- **Chunking invariance** (`check_chunkings`): the prompt's logprobs at every position, then
  transformers' greedy continuation teacher-forced through decode rows, at chunks of one block,
  two blocks, a non-multiple of the block size and one chunk (a chunk never splits an image, as
  the scheduler plans it), with layer slices where the family has them; each against
  transformers and against the one-chunk run.
- **Decode through the scheduler, cold and after a prefix hit** (`check_served`): 16 greedy
  tokens equal transformers', and the chosen token's logprob at every step within tolerance
  (one agreeing first token does not pass), at 16- and 32-token chunks; the hit (a
  conversation's next turn) reaches past the family's sparse reach, so the new positions'
  selections and windows draw on cached tokens.

Logprobs are compared (max |Δ| over the vocabulary at every position), not only tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.scheduling.request import PromptIds, Request
from dgpp.engine.scheduling.scheduler import ScheduledChunk, StepPlan
from dgpp.engine.vision.spans import chunk_end
from tests.engine.parity import earliest_ties, hf_greedy
from tests.engine.vision.vl_helpers import hf_vl_greedy, hf_vl_logits, vl_prompt

TOLERANCE = 1e-3  # |Δ logprob| at float32
NEW_TOKENS = 16
BLOCK = 16
# A vision-language prompt's images (grids in patches, merged 2x2): 3x4 and 2x5 tokens.
GRIDS = ((1, 6, 8), (1, 4, 10))


@dataclass(frozen=True)
class Family:
    """A tiny config of `architecture` whose sparse or windowed paths drop tokens in a prompt
    of `prompt_tokens` (`reach`: the most tokens such a layer attends to; 0 for dense)."""

    name: str
    architecture: str
    overrides: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 112
    reach: int = 0
    vision: bool = False
    # few indexer heads: scores tie at the budget's cut (the harness checks that one did)
    ties: bool = False


def prompt_of(family: Family, seed: int = 62) -> PromptIds:
    """The family's prompt: random token ids, around two images for a vision family."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 49000, (family.prompt_tokens,), generator=generator).tolist()
    if not family.vision:
        return PromptIds(text)
    images = sum(t * h * w // 4 + 2 for t, h, w in GRIDS)  # placeholders and markers
    rest = text[: family.prompt_tokens - images]
    parts = [rest[:20], (GRIDS[0], seed), rest[20:40], (GRIDS[1], seed + 1), rest[40:]]
    return vl_prompt(parts)


class Reference:
    """transformers on the same weights: greedy tokens, and float32 log-probabilities [S, V]
    over a prompt and its continuation (row p predicts token p + 1) in one forward. Its
    indexers' ties at the cut are taken earliest first, as dgpp's are (`earliest_ties`: left
    to the CPU's `torch.topk`, transformers disagrees with itself); `tied` records whether a
    cut fell among tied scores."""

    def __init__(self, model: torch.nn.Module, vision: bool) -> None:
        self.model = model
        self.vision = vision
        self.tied: list[bool] = []

    def greedy(self, prompt: PromptIds, count: int) -> list[int]:
        with earliest_ties(self.tied):
            if self.vision:
                return hf_vl_greedy(self.model, prompt, count)
            return hf_greedy(self.model, list(prompt), count)

    def logprobs(self, prompt: PromptIds, continuation: list[int]) -> torch.Tensor:
        with earliest_ties(self.tied):
            if self.vision:
                logits = hf_vl_logits(self.model, prompt, continuation)
            else:
                with torch.inference_mode():
                    sequence = torch.tensor([[*prompt, *continuation]])
                    logits = self.model(sequence).logits[0].float()
        return logits.log_softmax(dim=-1)


def forced_logprobs(
    llm: LLM,
    prompt: PromptIds,
    continuation: list[int],
    chunk: int,
    slices: tuple[int, ...] = (),
) -> torch.Tensor:
    """dgpp's log-probabilities [len(prompt) + len(continuation), V] at every position of
    `prompt + continuation`: the prompt's in prefill chunks of `chunk` tokens (scored as prompt
    logprobs are, each chunk in its own step; a chunk that would split an image ends before or
    after it), then one decode row per forced token, all through the paged cache. `slices`
    (layer boundaries, e.g. (1, 3) of 4 layers) computes each chunk of more than one token a
    few layers per step, as `layer_slices` plans it."""
    engine = llm.engine
    sequence = [*prompt, *continuation]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    request = Request("forced", list(prompt), params, max_tokens=1, images=prompt.images)
    total = int(getattr(engine.runner.model, "num_slice_layers", 0))
    rows: list[torch.Tensor] = []
    try:
        while request.num_computed_tokens < len(sequence):
            start = request.num_computed_tokens
            end = min(start + chunk, len(prompt)) if start < len(prompt) else start + 1
            num = chunk_end(request.image_spans, start, end) - start
            assert engine.block_manager.allocate_slots(request, num)
            bounds = (0, *slices, total) if slices and num > 1 else ()
            steps = [
                ScheduledChunk(request, start, num, layers=(first, stop, total))
                for first, stop in pairwise(bounds)
            ] or [ScheduledChunk(request, start, num)]
            for step in steps:
                with torch.inference_mode():
                    logits = engine.runner.run(StepPlan((step,), num_decodes=int(num == 1)))
            rows.append(logits.float())  # the last slice's: the chunk's scored and sampled rows
            request.num_computed_tokens += num
            if request.num_computed_tokens == request.num_tokens < len(sequence):
                request.token_ids.append(sequence[request.num_tokens])  # force the next
    finally:
        engine.block_manager.free(request)
    logits = torch.cat(rows)
    assert logits.shape[0] == len(sequence), (logits.shape, len(sequence))
    vocab = engine.runner.model_config.vocab_size
    return logits[:, :vocab].log_softmax(dim=-1)


def worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    """The largest |Δ logprob| and the first position off by more than the tolerance (-1)."""
    per_position = (got - want).abs().amax(dim=-1)
    off = (per_position > TOLERANCE).nonzero()
    return per_position.max().item(), int(off[0]) if len(off) else -1


def check_chunkings(llm: LLM, reference: Reference, family: Family) -> dict[str, float]:
    """Prompt and teacher-forced decode logprobs at every chunking (and layer slices where the
    family has them) equal transformers' and the one-chunk run's; returns the worst |Δ|
    against transformers per chunking (for the test's log)."""
    prompt = prompt_of(family)
    continuation = reference.greedy(prompt, NEW_TOKENS)
    want = reference.logprobs(prompt, continuation)
    whole = forced_logprobs(llm, prompt, continuation, len(prompt))
    chunkings: dict[str, tuple[int, tuple[int, ...]]] = {
        "one chunk": (len(prompt), ()),
        "1 block": (BLOCK, ()),
        "2 blocks": (2 * BLOCK, ()),
        "non-multiple": (BLOCK + 5, ()),
    }
    layers = int(getattr(llm.engine.runner.model, "num_slice_layers", 0))
    if layers > 1:
        chunkings["2 blocks, layer slices"] = (2 * BLOCK, tuple(range(1, layers)))
        chunkings["one chunk, layer slices"] = (len(prompt), (layers // 2,))
    figures = {}
    failures = []
    for name, (chunk, slices) in chunkings.items():
        got = (
            whole
            if name == "one chunk"
            else forced_logprobs(llm, prompt, continuation, chunk, slices)
        )
        against_hf, first_off = worst(got, want)
        against_whole, _ = worst(got, whole)
        figures[name] = against_hf
        if against_hf > TOLERANCE or against_whole > TOLERANCE:
            failures.append(
                f"{name}: |Δ| {against_hf:.4f} against transformers from position {first_off},"
                f" {against_whole:.4f} against one chunk"
            )
    assert not failures, f"{family.name}: " + "; ".join(failures)
    assert any(reference.tied) or not family.ties, f"{family.name}: no cut among tied scores"
    return figures


def served_tokens(llm: LLM, prompt: PromptIds) -> tuple[list[int], list[float], int]:
    """Greedy tokens through the engine's scheduler, each step's chosen-token logprob, and how
    many prompt tokens came from the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    output = llm.generate([prompt], params)[0]
    completion = output.outputs[0]
    assert completion.logprobs is not None
    logprobs = [entry.logprob for entry in completion.logprobs]
    return list(completion.token_ids), logprobs, output.num_cached_tokens


def decode_failure(
    reference: Reference, prompt: PromptIds, tokens: list[int], logprobs: list[float]
) -> str | None:
    """Every step's token equal to transformers' greedy one and its logprob within tolerance;
    a description of the first failure, or None."""
    expected = reference.greedy(prompt, NEW_TOKENS)
    if tokens != expected:
        step = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
        return f"greedy token {step} differs: {tokens[step]} against {expected[step]}"
    want = reference.logprobs(prompt, tokens)
    for step, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        expected_logprob = want[len(prompt) - 1 + step, token].item()
        if abs(logprob - expected_logprob) > TOLERANCE:
            return f"step {step}: logprob {logprob:.5f} against {expected_logprob:.5f}"
    return None


def check_served(llm: LLM, reference: Reference, family: Family) -> None:
    """At 16- and 32-token chunks, through the scheduler: a cold prompt's 16 greedy tokens and
    their logprobs, then a conversation's next turn (the prompt, the reply and new text) over
    the cached prompt (its images included), whose hit reaches past the family's reach."""
    engine = llm.engine
    failures = []
    for chunk in (BLOCK, 2 * BLOCK):
        engine.retune(dataclasses.replace(engine.config, prefill_chunk_tokens=chunk))
        prompt = prompt_of(family, seed=chunk)
        reply, logprobs, cached = served_tokens(llm, prompt)
        failure = decode_failure(reference, prompt, reply, logprobs)
        if failure:
            failures.append(f"cold at {chunk}-token chunks: {failure}")
        tail = prompt_of(family, seed=chunk + 1)[-9:]
        turn = PromptIds([*prompt, *reply, *tail], images=prompt.images)
        tokens, logprobs, cached = served_tokens(llm, turn)
        assert cached >= max(family.reach, len(prompt) // BLOCK * BLOCK), (family.name, cached)
        failure = decode_failure(reference, turn, tokens, logprobs)
        if failure:
            failures.append(f"after a {cached}-token hit at {chunk}-token chunks: {failure}")
    assert not failures, f"{family.name}: " + "; ".join(failures)


def check_family(checkpoint: Path, reference: Reference, family: Family) -> None:
    """The whole harness on one engine of the family's checkpoint."""
    llm = engine(checkpoint, family)
    figures = check_chunkings(llm, reference, family)
    print(family.name, {name: f"{value:.1e}" for name, value in figures.items()})
    check_served(llm, reference, family)
    assert llm.engine.block_manager.num_used_blocks == 0


def engine(checkpoint: Path, family: Family) -> LLM:
    """The family's one engine: float32, 16-token blocks, chunks as large as the prompt (the
    harness's own chunkings go below), every prompt offered to the prefix cache, and chunks
    bounded by tokens alone (layer slices are driven by `forced_logprobs`)."""
    return LLM(
        str(checkpoint),
        dtype="float32",
        block_size=BLOCK,
        prefill_chunk_tokens=family.prompt_tokens,
        kv_capacity=2048,
        prefix_min_tokens=0,
        step_target_ms=-1,
        seed=0,
    )
