"""Adaptive draft depth (`spec_adaptive`): how many tokens to draft for a request, from how its
recent drafts fared.

Per request, two running estimates (exponential moving averages, weight `RATE`): `first`, the
chance its first draft token is accepted, and `further`, the chance a chained token is accepted
once the one before it was. Drafting one more token pays about `first * further ** (d - 1)`
expected tokens for the cost of verifying and drafting it; the depth is the largest d (at most
the knob's `spec_depth`) whose last token still pays `THRESHOLD`, and at least 1. Priors start
optimistic, so a new request tries deeper drafts and backs off as they fail.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def depth(self, most: int) -> int:
        """The deepest draft whose last token still pays `THRESHOLD`, 1 .. `most`."""
        depth, gain = 1, self.first
        while depth < most and gain * self.further >= THRESHOLD:
            gain *= self.further
            depth += 1
        return depth
