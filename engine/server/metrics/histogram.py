"""A small cumulative histogram, and the bucket bounds of dgpp's latency metrics (vLLM's)."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

# Upper bounds in seconds; an observation equal to a bound falls in that bucket (Prometheus `le`).
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass
class Histogram:
    """Counts per bucket (not cumulative), their total and the sum of the observed values."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    count: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last bucket is +Inf

    def observe(self, value: float, weight: int = 1) -> None:
        """Record `value` `weight` times (a request's mean gap, once per gap)."""
        self.counts[bisect_left(self.bounds, value)] += weight
        self.count += weight
        self.total += value * weight

    def cumulative(self) -> list[tuple[float, int]]:
        """(bound, observations <= bound) for every bound and then infinity, as Prometheus
        exposes buckets."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out

    def copy(self) -> Histogram:
        clone = Histogram(self.bounds, count=self.count, total=self.total)
        clone.counts = list(self.counts)
        return clone
