"""A cap on reasoning tokens (OpenAI `reasoning_effort`, Anthropic `thinking.budget_tokens`).

A request may carry `SamplingParams.reasoning_budget` and the token ids that close its
reasoning block (`reasoning_end`, e.g. the ids of `</think>`, or gpt-oss's
`<|end|><|start|>assistant<|channel|>final<|message|>`). The block is open from the start when
the prompt opened it; else it opens when the output writes `reasoning_open` (`<think>`, or
`<|channel|>analysis<|message|>`). Once `reasoning_budget` tokens have been generated inside
it without the model closing it (with `reasoning_end`, or `reasoning_close` where the model's
own close is shorter: harmony's `<|end|>`), the sampler allows only the closing sequence,
token by token; the model then answers as usual. The output may not end inside the block, nor
after a forced close before its answer has something besides whitespace (`answer_due`): the
request's end tokens are masked meanwhile, so a budgeted request always ends with an answer.
Like a grammar it is a mask, so speculative drafts are checked against it, and a request
without a budget pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _step(sequence: tuple[int, ...], matched: int, token_id: int) -> int:
    """How much of `sequence` is matched after `token_id`, `matched` before it."""
    if token_id == sequence[matched]:
        return matched + 1
    return 1 if token_id == sequence[0] else 0


@dataclass
class ReasoningBudget:
    """Where a request is in its reasoning block: not open yet (`opens` left to match), inside
    it (`spent` tokens so far, `matched` of the closing sequence written), or closed."""

    budget: int
    end: tuple[int, ...]  # forced once the budget is spent
    opens: tuple[int, ...] = ()  # the output opens the block with these (empty: it is open)
    closes: tuple[int, ...] = ()  # the model's own close, where shorter than `end`
    spent: int = 0
    matched: int = 0
    closed: bool = False
    # The close was forced and the answer has no text yet (the output processor, which reads
    # the text, clears it): the request's end tokens are masked meanwhile
    answer_due: bool = False
    answer_from: int = 0  # the answer's first output token (after the forced close)
    seen: int = 0  # output tokens taken in while the block was not yet closed
    _opening: int = 0  # of `opens` matched so far
    _closing: int = 0  # of `closes` matched so far

    @property
    def is_open(self) -> bool:
        return not self.closed and self._opening == len(self.opens)

    def forced(self, num_generated: int | None = None) -> int | None:
        """The token the next position must be, or None when the model is free."""
        if not self.is_open or self.spent < self.budget:
            return None
        return self.end[self.matched]

    def advance(self, token_id: int) -> None:
        if self.closed:
            return
        self.seen += 1
        if not self.is_open:
            self._opening = _step(self.opens, self._opening, token_id)
            return
        forcing = self.spent >= self.budget
        self.spent += 1
        self.matched = _step(self.end, self.matched, token_id)
        if self.matched == len(self.end):
            self.closed = True
            self.answer_due, self.answer_from = forcing, self.seen
        elif self.closes and not forcing:
            self._closing = _step(self.closes, self._closing, token_id)
            self.closed = self._closing == len(self.closes)


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


def ban_rows(logits: torch.Tensor, banned: list[tuple[int, ...]]) -> None:
    """In place: row i of `logits` may not be any of `banned[i]`."""
    rows = [(i, list(tokens)) for i, tokens in enumerate(banned) if tokens]
    if not rows:
        return
    with torch.inference_mode():
        for row, tokens in rows:
            logits[row, tokens] = float("-inf")
