"""Sampling one step's logits, verifying speculative drafts on the way.

Positions are sampled in depth order: depth 0 of every sampled chunk first (the plain next token),
then depth 1 of the verify rows whose depth-0 token equalled their first draft token, and so on.
Each request's token at depth `d` is drawn with the history of the tokens it emitted before, by
the same sampler call plain decoding makes, so speculation never changes what is generated (see
`dgpp.engine.speculative`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dgpp.engine.request import Request
from dgpp.engine.sampler import SamplerOutput, TokenLogprobs
from dgpp.engine.scheduler import ScheduledChunk, StepPlan
from dgpp.engine.speculative import SpecCounters

SampleRows = Callable[[torch.Tensor, Sequence[Request]], SamplerOutput]
AppendToken = Callable[[Request, int, TokenLogprobs | None], None]


@dataclass
class _Row:
    chunk: ScheduledChunk
    offset: int  # the chunk's first sampled row in the step's logits
    emitted: int = 0
    accepted: int = 0

    @property
    def request(self) -> Request:
        return self.chunk.request


def sample_plan(
    plan: StepPlan,
    logits: torch.Tensor,
    sample: SampleRows,
    append: AppendToken,
    verified: Callable[[Request], None],
    counters: SpecCounters,
) -> list[tuple[Request, int]]:
    """Sample every sampled chunk of `plan` from `logits` [plan.num_sampled, V] and `append` each
    token. A verify row's request gets `verified(request)` once per accepted draft token, before
    the token after it is appended (its key and value are then known to be right). Returns each
    sampled request with the number of tokens it got this step."""
    rows: list[_Row] = []
    offset = 0
    for chunk in plan.chunks:
        if chunk.num_sampled:
            rows.append(_Row(chunk, offset))
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
        result = sample(part, [row.request for row in alive])
        survivors = []
        for row, token_id, logprobs in zip(alive, result.token_ids, result.logprobs, strict=True):
            request = row.request
            if depth:
                verified(request)
            append(request, token_id, logprobs)
            row.emitted += 1
            draft = row.chunk.draft
            if depth < len(draft) and token_id == draft[depth]:
                row.accepted += 1
                if not request.is_finished:
                    survivors.append(row)
        alive = survivors
        depth += 1
    for row in rows:
        if row.chunk.draft:
            counters.record(len(row.chunk.draft), row.accepted)
    return [(row.request, row.emitted) for row in rows]
