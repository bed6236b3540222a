"""A cap on reasoning tokens (Anthropic `thinking.budget_tokens`).

A request whose output starts inside a reasoning block (the prompt opened `<think>`) may carry
`SamplingParams.reasoning_budget` and the token ids that close the block
(`reasoning_end`, e.g. the ids of `</think>`). Once it has generated `reasoning_budget` tokens
without closing the block, the sampler allows only the next closing token until the block is
closed; the model then answers as usual. Like a grammar, it is a mask, so speculative drafts
are checked against it and a request without a budget pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReasoningBudget:
    """Where a request is in its reasoning block: how much of the closing sequence it has
    written (`matched`), and whether the block is closed."""

    budget: int
    end: tuple[int, ...]
    matched: int = 0
    closed: bool = False

    def forced(self, num_generated: int) -> int | None:
        """The token the next position must be, or None when the model is free."""
        if self.closed or num_generated < self.budget:
            return None
        return self.end[self.matched]

    def advance(self, token_id: int) -> None:
        if self.closed:
            return
        if token_id == self.end[self.matched]:
            self.matched += 1
        else:
            self.matched = 1 if token_id == self.end[0] else 0
        if self.matched == len(self.end):
            self.closed = True


def force_rows(logits: torch.Tensor, forced: list[int | None]) -> None:
    """In place: row i of `logits` allows only `forced[i]` where that is set."""
    rows = [(i, token) for i, token in enumerate(forced) if token is not None]
    if not rows:
        return
    with torch.inference_mode():  # the step's logits are inference tensors
        for row, token in rows:
            keep = logits[row, token].clone()
            logits[row].fill_(float("-inf"))
            logits[row, token] = keep
