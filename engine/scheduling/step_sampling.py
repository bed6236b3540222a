"""Sampling one step's logits, verifying speculative drafts on the way.

Positions are sampled in depth order: depth 0 of every sampled chunk first (the plain next token),
then depth 1 of the verify rows whose depth-0 token equalled their first draft token, and so on.
Each request's token at depth `d` is drawn with the history of the tokens it drew before, by the
same sampler call plain decoding makes, so speculation never changes what is generated (see
`dgpp.engine.speculative.ngram`). Sampling decides; it changes no request but its grammar matcher
(which consumes every token drawn): the output processor appends what it returns and stops at the
first token that finishes the request.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from dgpp.engine.planning.memory_plan import SCORE_ROWS
from dgpp.engine.sampling.grammar import consume, mask_rows
from dgpp.engine.sampling.reasoning_budget import ban_rows, force_rows
from dgpp.engine.sampling.sampler import Sampler, SamplerRow, TokenLogprobs, scored_logprobs
from dgpp.engine.scheduling.request import Request
from dgpp.engine.scheduling.scheduler import ScheduledChunk, StepPlan


@dataclass
class SampledRow:
    """The tokens one sampled chunk produced this step, in order: the next token, then one more
    for each draft token it confirmed (a verify row's first mismatch is the last token drawn)."""

    chunk: ScheduledChunk
    offset: int  # the chunk's first sampled row in the step's logits
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    @property
    def request(self) -> Request:
        return self.chunk.request

    def num_accepted(self, num_used: int) -> int:
        """Draft tokens confirmed among the first `num_used` tokens drawn."""
        draft = self.chunk.draft
        used = self.token_ids[: min(num_used, len(draft))]
        return sum(token == proposed for token, proposed in zip(used, draft, strict=False))


def sample_step(
    plan: StepPlan,
    logits: torch.Tensor,
    sampler: Sampler,
    generator: torch.Generator,
    eos_token_ids: Collection[int] = (),
) -> list[SampledRow]:
    """Sample every sampled chunk of `plan` from `logits` [plan.num_sampled, V], in plan order.
    `eos_token_ids` end a request (masked while a forced close waits for its answer)."""
    rows: list[SampledRow] = []
    offset = 0
    for chunk in plan.chunks:
        scored = chunk.num_scored
        if scored:
            _score_prompt(chunk, logits[offset : offset + scored], sampler.vocab_size)
        if chunk.num_sampled > scored:
            rows.append(SampledRow(chunk, offset + scored))
        offset += chunk.num_sampled
    assert offset == logits.shape[0], "the step's logits do not match its plan"
    alive = rows
    depth = 0
    while alive:
        if depth == 0 and len(alive) == offset:
            part = logits
        else:
            index = torch.tensor([row.offset + depth for row in alive], device=logits.device)
            part = logits.index_select(0, index)
        mask_rows(part, [row.request.matcher for row in alive])  # rows with a grammar only
        force_rows(part, [_forced(row) for row in alive])  # rows over their reasoning budget
        ban_rows(part, [_no_end(row, eos_token_ids) for row in alive])  # and their answers
        result = sampler(part, [_sampler_row(row) for row in alive], generator)
        survivors = []
        for row, token_id, logprobs in zip(alive, result.token_ids, result.logprobs, strict=True):
            row.token_ids.append(token_id)
            row.logprobs.append(logprobs)
            if row.request.matcher is not None:
                row.request.matcher = consume(row.request.matcher, token_id, row.request.request_id)
            if row.request.reasoning is not None:
                row.request.reasoning.advance(token_id)
            draft = row.chunk.draft
            if depth < len(draft) and token_id == draft[depth]:
                survivors.append(row)
        alive = survivors
        depth += 1
    return rows


def _score_prompt(chunk: ScheduledChunk, logits: torch.Tensor, vocab_size: int) -> None:
    """Record the log-probability of each prompt token the chunk's positions predict, in slices
    of `SCORE_ROWS` positions (the float32 log-softmax of a whole chunk would be [chunk, V])."""
    request, first = chunk.request, chunk.start + 1  # position p's logits predict token p + 1
    logits = logits[:, :vocab_size]
    if request.score_sink is not None:
        request.score_sink(first, logits)
        return
    n = request.params.prompt_logprobs or 0
    for begin in range(0, logits.shape[0], SCORE_ROWS):
        rows = logits[begin : begin + SCORE_ROWS]
        at = first + begin
        index = torch.tensor(request.token_ids[at : at + rows.shape[0]], device=logits.device)
        for offset, scored in enumerate(scored_logprobs(rows, index, n)):
            request.prompt_logprobs[at + offset] = scored


def _forced(row: SampledRow) -> int | None:
    budget = row.request.reasoning
    if budget is None:
        return None
    return budget.forced(len(row.request.output_token_ids) + len(row.token_ids))


def _no_end(row: SampledRow, eos_token_ids: Collection[int]) -> tuple[int, ...]:
    """The tokens a row may not draw: its end tokens inside its reasoning block (the model
    closes it, or the budget does) and after a forced close until its answer has text."""
    budget = row.request.reasoning
    if budget is None or row.request.params.ignore_eos:
        return ()
    if not budget.is_open and not budget.answer_due:
        return ()
    return (*eos_token_ids, *row.request.params.stop_token_ids)


def _sampler_row(row: SampledRow) -> SamplerRow:
    request = row.request
    params = request.params
    needs_history = (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )
    return SamplerRow(
        params=params,
        prompt_token_ids=request.prompt_token_ids if needs_history else (),
        output_token_ids=[*request.output_token_ids, *row.token_ids] if needs_history else (),
        generator=request.generator,
    )
