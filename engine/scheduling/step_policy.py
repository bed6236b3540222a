"""How one step's prompt-token budget is shared: the interactive policy.

Every running stream gets its decode row first (scheduler). The prompt budget
(`prefill_chunk_tokens`) then goes to the prompts of the best rank (`priority`: all alike unless
requests carry priorities; lower ranks wait until aging lifts them), in this order:

1. short prompts (at most `short_prompt_tokens` left to compute), running ones before waiting
   ones, each in arrival order: a one-line request arriving during a long prefill is computed
   in the next step instead of after the long prompt;
2. long prompts, in arrival order, with what is left.

While short prompts wait, `long_prefill_share` of the budget is kept for the oldest long prompt,
so it advances every step and finishes in bounded time however many short ones arrive; with no
short prompt waiting it takes the whole budget.

Step time (`bound`): a step's long prompts get only the tokens that keep it within a target
predicted by `step_times`, so no latency-sensitive work waits for a whole long chunk:

- with decode rows or short prompts in the step, `STRETCH` times the predicted time of that
  sensitive work alone (or `step_target_ms`), and no later than each short prompt's deadline:
  its arrival plus `STRETCH` times its solo first-token time. Inter-token latency and a short
  prompt's first token stay within about twice what they are without the long prompt;
- with only long prompt work, while an arrival is likely (`arrival_hold_s` after the latest
  arrival), `ARRIVAL_WAIT` times a typical short request's solo first-token step: a request
  arriving in the middle of it waits about that long, then gets its own step before its
  deadline. Never less than half such a step is the long prompt's tokens' own work, so where
  steps are mostly fixed cost (a GPU's launch-bound step, a CPU's chunk at a long position that
  reads its whole context) a lone long prompt keeps at least half its speed. Once the hold has
  passed, a long-only step may last as long as the quiet time since the hold ended: long chunks
  grow back to the whole budget in a few steps.

In plain decoders (`num_layers`) the oldest long prompt's chunk goes in layer slices instead
(`layer_slices`): it keeps a size whose fixed costs are small and each step computes the layers
that fit the bound; its long-only steps stay bounded always (0.75 x a typical solo short step,
no hold and no growth: a slice is as efficient in a short step as in a long one).

Beside sensitive work, a chunk of the few tokens the bound leaves can be mostly fixed cost; the
oldest long prompt then sits the step out and banks its time (`LongCredit`), spending it a few
steps later in one chunk that is at least half its tokens' work: the same share of time, most
of it useful. It sits out at most `MAX_SKIPS` steps in a row; then, and whenever it runs, it
gets at least `MIN_CHUNK` tokens, so it finishes in bounded time. `step_target_ms` < 0 turns
the bound off (first-come-first-served steps, short prompts still first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.scheduling.layer_slices import plan_slice, slice_seconds
from dgpp.engine.scheduling.request import Request
from dgpp.engine.scheduling.step_times import StepTimes

MIN_CHUNK = 4  # prompt tokens the oldest long prompt may always compute, whatever the timings
# The least share of a bounded long-only step that is the long prompt's tokens' own work.
USEFUL = 0.5
MAX_SKIPS = 16  # steps in a row the oldest long prompt may sit out to bank a worthwhile chunk
STRETCH = 1.75  # a bounded step's target: this many times its latency-sensitive work alone
# A long-only step while an arrival is likely: this many typical solo short steps, so an arrival
# mid-step plus its own step stays within STRETCH of its solo time.
ARRIVAL_WAIT = STRETCH - 1.0


@dataclass
class LongCredit:
    """Prompt time the oldest long prompt was due in steps it sat out (scheduler state).

    Beside latency-sensitive work a step leaves a long prompt a little time; at a long position a
    chunk that small is mostly fixed cost (reading its whole context), so the prompt sits the step
    out and banks the time instead, and spends it in one worthwhile chunk a few steps later: the
    same share of time, most of it on tokens. `MAX_SKIPS` steps out in a row at most."""

    seconds: float = 0.0
    skipped: int = 0
    owner: int = 0  # id() of the request the time is banked for

    def bank(self, owner: int, seconds: float) -> bool:
        """Sit this step out, banking `seconds`; False when it has sat out too many already."""
        if owner != self.owner:  # banked for a request that is gone or no longer the oldest
            self.seconds, self.skipped, self.owner = 0.0, 0, owner
        if self.skipped >= MAX_SKIPS:
            return False
        self.seconds += seconds
        self.skipped += 1
        return True

    def take(self) -> float:
        """The banked time, spent in this step's chunk."""
        seconds, self.seconds, self.skipped = self.seconds, 0.0, 0
        return seconds


def _efficient(times: StepTimes, tokens: int, start: int) -> bool:
    """The chunk's tokens' own work is at least what it costs beyond them."""
    if tokens <= 0:
        return False
    overhead = times.chunk_overhead(tokens, start)
    return times.prompt_seconds(tokens, start) - overhead >= overhead


@dataclass(frozen=True)
class StepPolicy:
    prefill_chunk_tokens: int = 512
    short_prompt_tokens: int = 256
    long_prefill_share: float = 0.25
    step_target_ms: float = 0.0  # 0: STRETCH x the sensitive work; < 0: no step-time bound
    arrival_hold_s: float = 1.0  # long-only steps stay bounded this long after an arrival
    num_layers: int = 0  # the model's layers when chunks may be sliced by layer, else 0
    whole_prompts: bool = False  # an encoder's: a prompt is computed in one step, or waits

    def bound(
        self,
        amounts: dict[int, int],
        prompts: Sequence[Request],
        num_decodes: int,
        times: StepTimes,
        now: float,
        last_arrival: float | None = None,
        credit: LongCredit | None = None,
        slices: dict[int, int] | None = None,
    ) -> dict[int, int]:
        """`amounts` (from `share`) with long prompts cut to the step-time bound (see the module
        docstring); `now` and `last_arrival` are `time.monotonic()` instants; `credit` carries
        the oldest long prompt's banked time from step to step. Where the oldest long prompt's
        chunk is computed in layer slices (`num_layers`), `slices` receives its layers this
        step by request id, and its amount is the chunk's tokens."""
        if self.step_target_ms < 0 or not times.ready or self.whole_prompts:
            return amounts
        planned = [r for r in self.order([], list(prompts)) if id(r) in amounts]
        longs = [r for r in planned if not self.is_short(r)]
        if not longs:
            return amounts
        spare = self._spare(amounts, planned, longs[0], num_decodes, times, now, last_arrival)
        if spare is None:
            return amounts
        credit = credit if credit is not None else LongCredit()
        bounded = dict(amounts)
        oldest, beside = longs[0], len(planned) > len(longs) or num_decodes > 0
        for request in longs:
            start, most = request.num_computed_tokens, amounts[id(request)]
            if request is oldest and self.num_layers and slices is not None:
                sliced = self._slice(times, request, spare, most, credit, beside)
                if sliced is not None:
                    tokens, layers = sliced
                    if layers == 0:  # sat out, its time banked
                        del bounded[id(request)]
                        spare = 0.0
                        continue
                    bounded[id(request)], slices[id(request)] = tokens, layers
                    spare -= slice_seconds(times, tokens, start, layers, self.num_layers)
                    continue
            if request is oldest:
                tokens = times.tokens_within(spare + credit.seconds, start, most)
                poor = beside and tokens < most and not _efficient(times, tokens, start)
                if poor and credit.bank(id(request), spare):  # a worthwhile chunk later instead
                    del bounded[id(request)]
                    spare = 0.0
                    continue
                tokens = max(tokens, min(MIN_CHUNK, most))
                spare += credit.take()
            else:
                tokens = times.tokens_within(spare, start, most)
            if tokens <= 0:
                del bounded[id(request)]
                continue
            bounded[id(request)] = tokens
            spare -= times.prompt_seconds(tokens, start)
        return bounded

    def _slice(
        self,
        times: StepTimes,
        request: Request,
        spare: float,
        most: int,
        credit: LongCredit,
        beside: bool,
    ) -> tuple[int, int] | None:
        """The oldest long prompt's (tokens, layers) in layer slices (`layer_slices`): layers 0
        where it sits this step out, banking `spare`; None: a plain chunk instead."""
        assert times.decode_step_s is not None
        # A new chunk is sized so one layer fits a typical step of its kind: a bounded
        # long-only step, or beside decode rows what they leave (each step then carries a
        # layer, rather than a few banking for one).
        if beside:
            reference = (STRETCH - 1) * times.decode_step_s
        else:
            reference = ARRIVAL_WAIT * times.solo_short_s()
        allowance = spare + credit.seconds
        planned = plan_slice(times, request, allowance, most, self.num_layers, reference)
        if planned is None:
            return None
        tokens, layers = planned
        if layers == 0 and beside and credit.bank(id(request), spare):
            return tokens, 0
        credit.take()
        return tokens, max(layers, 1)

    def _spare(
        self,
        amounts: dict[int, int],
        planned: list[Request],
        oldest_long: Request,
        num_decodes: int,
        times: StepTimes,
        now: float,
        last_arrival: float | None,
    ) -> float | None:
        """Seconds of long prompt work the step may hold beside its other work; None: no bound."""
        assert times.decode_step_s is not None
        base = times.decode_step_s
        shorts = [r for r in planned if self.is_short(r)]
        if not (num_decodes or shorts):
            if self.num_layers:
                # Layer slices: a step of any length keeps the chunk efficient and pays its
                # share of the base (no base beside it), so long-only steps stay bounded.
                return ARRIVAL_WAIT * times.solo_short_s()
            if last_arrival is None:
                return None
            # Past the hold, a long-only step may last as long as the quiet after the hold: its
            # length about doubles step by step up to the whole budget, without a cliff. Never
            # less than half the step is the long prompt's tokens' own work: where steps are
            # mostly fixed cost (a GPU's launch-bound step, a CPU's chunk at a long position)
            # a long prompt alone keeps at least half its speed.
            # The context read only: the fitted fixed cost d moves with the mix of chunk sizes
            # (a CPU's large chunks switch kernels) and must not widen an arrival's wait.
            grown = now - last_arrival - self.arrival_hold_s
            overhead = times.context_read(oldest_long.num_computed_tokens)
            floor = overhead + USEFUL / (1 - USEFUL) * (base + overhead)
            return max(ARRIVAL_WAIT * times.solo_short_s() - base, grown - base, floor)
        sensitive = base
        target = math.inf
        for request in shorts:
            cost = times.prompt_seconds(amounts[id(request)], request.num_computed_tokens)
            sensitive += cost
            if amounts[id(request)] == request.num_pending_tokens:  # its first token is due
                solo = base + times.prompt_seconds(
                    request.num_pending_tokens, request.num_computed_tokens
                )
                target = min(target, STRETCH * solo - (now - request.arrival_time))
        stretch = self.step_target_ms / 1000.0 if self.step_target_ms > 0 else STRETCH * sensitive
        return max(min(stretch, target) - sensitive, 0.0)

    @classmethod
    def of(cls, config: EngineConfig, model: object) -> StepPolicy:
        """The policy of `config`; long prompt chunks go in layer slices where `model` allows
        (`dgpp.engine.scheduling.layer_slices`; MTP reads every step's last hidden states)."""
        slices = config.speculative != "mtp" and config.step_target_ms >= 0
        return cls(
            num_layers=getattr(model, "num_slice_layers", 0) if slices else 0,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            short_prompt_tokens=config.short_prompt_tokens,
            long_prefill_share=config.long_prefill_share,
            step_target_ms=config.step_target_ms,
            arrival_hold_s=config.arrival_hold_ms / 1000.0,
            whole_prompts=getattr(model, "whole_prompts", False),
        )

    def is_short(self, request: Request) -> bool:
        return request.num_pending_tokens <= self.short_prompt_tokens

    def order(self, running: list[Request], waiting: list[Request]) -> list[Request]:
        """Prompts in the order they get the budget (see the module docstring), by rank first
        (`dgpp.engine.scheduling.priority`: all equal unless requests carry priorities)."""
        shorts = [r for r in running if self.is_short(r)] + [r for r in waiting if self.is_short(r)]
        longs = [r for r in running if not self.is_short(r)] + [
            r for r in waiting if not self.is_short(r)
        ]
        return sorted(shorts + longs, key=lambda request: request.rank)

    def share(self, budget: int, running: list[Request], waiting: list[Request]) -> dict[int, int]:
        """Prompt tokens per request id: shorts first, then longs, the oldest long keeping
        `long_prefill_share` of the budget while short prompts are served (see the module
        docstring). Waiting requests that find no blocks leave their share unused. Only the
        best rank's prompts share it (`priority`: the others wait; aging lifts them)."""
        ordered = self.order(running, waiting)
        ordered = [r for r in ordered if r.rank == ordered[0].rank]
        if self.whole_prompts:  # in order, each prompt whole while the budget holds it
            whole: dict[int, int] = {}
            for request in ordered:
                if request.num_pending_tokens > budget:
                    break
                whole[id(request)] = request.num_pending_tokens
                budget -= request.num_pending_tokens
            return whole
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
