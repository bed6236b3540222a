"""Per-interval quantiles of the engine's latency histograms (its Prometheus `GET /metrics`).

The engine's histograms are cumulative since it started. The quantile of one sampling interval
comes from the difference of two readings' bucket counts, interpolated linearly inside the
bucket that holds the rank, as Prometheus' `histogram_quantile(q, increase(x_bucket[...]))`
does. Its resolution is the bucket bounds' (engine/server/metrics/histogram.py): a p95 between
0.25 s and 0.5 s is placed by the share of the bucket's observations below the rank, not
measured."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# Chart key -> the engine's histogram family (docs/metrics.md); labels (cache, model_name) summed.
LATENCY_FAMILIES = {
    "ttft": "dgpp:time_to_first_token_seconds",
    "itl": "dgpp:inter_token_latency_seconds",
    "e2e": "dgpp:e2e_request_latency_seconds",
}


@dataclass(frozen=True)
class Buckets:
    """One histogram: upper bounds ascending, the last +Inf, and the observations at or below
    each (cumulative, Prometheus `le`)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def since(self, before: Buckets) -> Buckets | None:
        """The observations made after `before` was read; None when the two do not compare:
        other bounds, or a count that went down (the engine restarted in between)."""
        if self.bounds != before.bounds:
            return None
        deltas = tuple(now - then for now, then in zip(self.counts, before.counts, strict=True))
        if any(delta < 0 for delta in deltas):
            return None
        return Buckets(self.bounds, deltas)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 < q < 1) of these observations; None when there are none. A rank in
        the +Inf bucket answers the largest finite bound (nothing larger is known)."""
        total = self.total
        if total <= 0 or len(self.bounds) < 2 or not math.isinf(self.bounds[-1]):
            return None
        rank = q * total
        index = next(i for i, count in enumerate(self.counts) if count >= rank)
        if index == len(self.bounds) - 1:
            return self.bounds[-2]
        upper, count = self.bounds[index], self.counts[index]
        lower, below = (self.bounds[index - 1], self.counts[index - 1]) if index else (0.0, 0.0)
        if index == 0 and upper <= 0:
            return upper
        return lower + (upper - lower) * (rank - below) / (count - below)


def read_histograms(text: str, names: Iterable[str]) -> dict[str, Buckets]:
    """The histograms `names` in a Prometheus text exposition, each summed over its label sets
    (every label but `le`). A family that is absent is left out; text that does not parse gives
    no histograms (logged)."""
    wanted = set(names)
    sums: dict[str, dict[float, float]] = {name: defaultdict(float) for name in wanted}
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in wanted or family.type != "histogram":
                continue
            for sample in family.samples:
                if sample.name == f"{family.name}_bucket":
                    sums[family.name][float(sample.labels["le"])] += sample.value
    except (ValueError, KeyError) as err:
        log.warning("cannot parse the engine's /metrics: %s", err)
        return {}
    return {
        name: Buckets(tuple(sorted(by_bound)), tuple(by_bound[b] for b in sorted(by_bound)))
        for name, by_bound in sums.items()
        if by_bound
    }
