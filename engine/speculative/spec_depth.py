"""Adaptive draft depth (`spec_adaptive`): how many tokens to draft for a request, from how its
recent drafts fared.

Per request, two running estimates (exponential moving averages, weight `RATE`): `first`, the
chance its first draft token is accepted, and `further`, the chance a chained token is accepted
once the one before it was. Drafting one more token pays about `first * further ** (d - 1)`
expected tokens for the cost of verifying and drafting it; the depth is the largest d (at most
the knob's `spec_depth`) whose last token still pays `THRESHOLD`, and at least 1. Priors start
optimistic, so a new request tries deeper drafts and backs off as they fail.

Batch-aware: a draft token costs one more query position in the verify forward (and one more
pass of the draft layer), about what a prompt token costs (`StepTimes.token_cost`); a plain
decode step of R rows gives R tokens for `decode_step_s`, so a token the plain way costs
`decode_step_s / R`. Where a draft token costs more than its expected yield buys the plain way
(a large, compute-bound batch), the bar rises above `THRESHOLD` to that ratio, and a request
whose first draft token no longer clears it does not draft at all that step.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgpp.engine.scheduling.step_times import StepTimes

RATE = 0.25  # weight of each new observation
THRESHOLD = 0.5  # expected accepted tokens a further draft token must bring
PRIOR_FIRST, PRIOR_FURTHER = 0.8, 0.7


@dataclass
class Acceptance:
    first: float = PRIOR_FIRST
    further: float = PRIOR_FURTHER

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify row of `drafted` tokens of which the first `accepted` were accepted."""
        if drafted < 1:
            return
        self.first += RATE * ((accepted >= 1) - self.first)
        for position in range(2, min(drafted, accepted + 1) + 1):  # tried: the one before held
            self.further += RATE * ((accepted >= position) - self.further)

    def depth(self, most: int, threshold: float = THRESHOLD) -> int:
        """The deepest draft whose last token still pays `threshold`, 1 .. `most`; 0 when a
        raised bar (`pay_threshold`) is not met even by the first token."""
        if threshold > THRESHOLD and self.first < threshold:
            return 0
        depth, gain = 1, self.first
        while depth < most and gain * self.further >= threshold:
            gain *= self.further
            depth += 1
        return depth


def pay_threshold(times: StepTimes | None, decode_rows: int, position: int) -> float:
    """What a further draft token must bring in a step of `decode_rows` decode rows at about
    `position`: `THRESHOLD`, or the cost of its verify position over a plain decode step's
    share of one token where that is more (see the module's docstring)."""
    if times is None or not times.ready or decode_rows < 1 or not times.decode_step_s:
        return THRESHOLD
    a, b = times.token_cost()
    return max(THRESHOLD, (a + b * position) * decode_rows / times.decode_step_s)
