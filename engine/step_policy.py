"""How one step's prompt-token budget is shared: the interactive policy.

Every running stream gets its decode row first (scheduler). The prompt budget then goes to
prompts in this order:

1. short prompts (at most `short_prompt_tokens` left to compute), running ones before waiting
   ones, each in arrival order: a one-line request arriving during a long prefill is computed
   in the next step instead of after the long prompt;
2. long prompts, in arrival order, with what is left.

While short prompts wait, `long_prefill_share` of the budget is kept for the oldest long prompt,
so it advances every step and finishes in bounded time however many short ones arrive; with no
short prompt waiting it takes the whole budget.

Step time: while streams are decoding, the budget shrinks so a step with prompt work stays near
`step_target_ms` (0: twice the measured decode-only step), from running averages of the
decode-only step time and of the time per prompt token; inter-token latency then stays bounded
when a long prompt arrives. With no stream decoding, the whole `prefill_chunk_tokens` is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dgpp.engine.request import Request

EWMA = 0.2  # weight of the newest step in the running averages
MIN_CHUNK = 16  # prompt tokens a step may always compute, whatever the timings say


@dataclass
class StepTimes:
    """Running averages of what steps cost: decode-only steps, and per prompt token."""

    decode_step_s: float | None = None
    prompt_token_s: float | None = None

    def observe(self, seconds: float, num_prompt_tokens: int, num_decodes: int) -> None:
        if num_prompt_tokens == 0:
            self.decode_step_s = _average(self.decode_step_s, seconds)
            return
        base = self.decode_step_s if num_decodes and self.decode_step_s is not None else 0.0
        per_token = max(seconds - base, 0.0) / num_prompt_tokens
        self.prompt_token_s = _average(self.prompt_token_s, per_token)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


@dataclass(frozen=True)
class StepPolicy:
    prefill_chunk_tokens: int = 512
    short_prompt_tokens: int = 256
    long_prefill_share: float = 0.25
    step_target_ms: float = 0.0  # 0: twice the decode-only step; < 0: no step-time bound

    def budget(self, times: StepTimes, has_decodes: bool) -> int:
        """The prompt tokens this step may compute."""
        full = self.prefill_chunk_tokens
        if not has_decodes or self.step_target_ms < 0 or times.prompt_token_s is None:
            return full
        if self.step_target_ms > 0:
            target = self.step_target_ms / 1000.0
        elif times.decode_step_s is not None:
            target = 2.0 * times.decode_step_s
        else:
            return full
        spare = target - (times.decode_step_s or 0.0)
        tokens = math.floor(spare / times.prompt_token_s + 1e-6) if times.prompt_token_s else full
        return max(min(tokens, full), min(MIN_CHUNK, full))

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
