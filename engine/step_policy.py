"""How one step's prompt-token budget is shared: the interactive policy.

Every running stream gets its decode row first (scheduler). The prompt budget
(`prefill_chunk_tokens`) then goes to prompts in this order:

1. short prompts (at most `short_prompt_tokens` left to compute), running ones before waiting
   ones, each in arrival order: a one-line request arriving during a long prefill is computed
   in the next step instead of after the long prompt;
2. long prompts, in arrival order, with what is left.

While short prompts wait, `long_prefill_share` of the budget is kept for the oldest long prompt,
so it advances every step and finishes in bounded time however many short ones arrive; with no
short prompt waiting it takes the whole budget.

Step time: when a step carries latency-sensitive work (decode rows, short prompts), its long
prompts get only the tokens that keep the step within `step_target_ms`, by default
`STRETCH` times the predicted time of the sensitive work alone (`step_times`), so
inter-token latency and a short prompt's first token stay within about twice what they are
without the long prompt. The oldest long prompt always gets at least `MIN_CHUNK` tokens. With
nothing sensitive in the step, the whole budget is used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dgpp.engine.request import Request
from dgpp.engine.step_times import StepTimes

MIN_CHUNK = 4  # prompt tokens the oldest long prompt may always compute, whatever the timings
STRETCH = 1.75  # a bounded step's target: this many times its latency-sensitive work alone


@dataclass(frozen=True)
class StepPolicy:
    prefill_chunk_tokens: int = 512
    short_prompt_tokens: int = 256
    long_prefill_share: float = 0.25
    step_target_ms: float = 0.0  # 0: STRETCH x the sensitive work; < 0: no step-time bound

    def bound(
        self,
        amounts: dict[int, int],
        prompts: Sequence[Request],
        num_decodes: int,
        times: StepTimes,
    ) -> dict[int, int]:
        """`amounts` (from `share`) with long prompts cut to the step-time bound, when the step
        carries decode rows or short prompts (see the module docstring)."""
        planned = [r for r in self.order([], list(prompts)) if id(r) in amounts]
        shorts = [r for r in planned if self.is_short(r)]
        if self.step_target_ms < 0 or not times.ready or not (num_decodes or shorts):
            return amounts
        assert times.decode_step_s is not None
        sensitive = times.decode_step_s + sum(
            times.prompt_seconds(amounts[id(r)], r.num_computed_tokens) for r in shorts
        )
        target = self.step_target_ms / 1000.0 if self.step_target_ms > 0 else STRETCH * sensitive
        spare = target - sensitive
        bounded = dict(amounts)
        oldest = True
        for request in (r for r in planned if not self.is_short(r)):
            start, most = request.num_computed_tokens, amounts[id(request)]
            tokens = times.tokens_within(spare, start, most)
            if oldest:
                tokens = max(tokens, min(MIN_CHUNK, most))
                oldest = False
            if tokens <= 0:
                del bounded[id(request)]
                continue
            bounded[id(request)] = tokens
            spare -= times.prompt_seconds(tokens, start)
        return bounded

    def is_short(self, request: Request) -> bool:
        return request.num_pending_tokens <= self.short_prompt_tokens

    def order(self, running: list[Request], waiting: list[Request]) -> list[Request]:
        """Prompts in the order they get the budget (see the module docstring)."""
        shorts = [r for r in running if self.is_short(r)] + [r for r in waiting if self.is_short(r)]
        longs = [r for r in running if not self.is_short(r)] + [
            r for r in waiting if not self.is_short(r)
        ]
        return shorts + longs

    def share(self, budget: int, running: list[Request], waiting: list[Request]) -> dict[int, int]:
        """Prompt tokens per request id: shorts first, then longs, the oldest long keeping
        `long_prefill_share` of the budget while short prompts are served (see the module
        docstring). Waiting requests that find no blocks leave their share unused."""
        ordered = self.order(running, waiting)
        longs = [r for r in ordered if not self.is_short(r)]
        reserve = 0
        if longs and len(longs) < len(ordered):
            reserve = min(budget, math.ceil(budget * self.long_prefill_share))
            if reserve == budget:  # a budget too small to share: the older of the two goes
                age = {id(r): i for i, r in enumerate([*running, *waiting])}
                if age[id(ordered[0])] < age[id(longs[0])]:
                    reserve = budget - 1
        amounts: dict[int, int] = {}
        for request in ordered:
            oldest_long = bool(longs) and request is longs[0]
            room = budget - (0 if oldest_long else reserve)
            if oldest_long:
                reserve = 0
            tokens = min(request.num_pending_tokens, room)
            if tokens > 0:
                amounts[id(request)] = tokens
                budget -= tokens
        return amounts
