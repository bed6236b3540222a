"""The Prometheus families by request priority (`SamplingParams.priority`, lower runs first):
requests waiting and running now, and the latency histograms of finished choices."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from dgpp.engine.scheduling.stats import EngineStats
from dgpp.engine.server.metrics.service import Latencies

LABELS = ["model_name", "priority"]
HISTOGRAMS = (
    ("ttft", "dgpp:time_to_first_token_by_priority_seconds", "Arrival to first token"),
    ("queue", "dgpp:request_queue_time_by_priority_seconds", "Arrival to first scheduled"),
    ("itl", "dgpp:inter_token_latency_by_priority_seconds", "Mean gap between tokens"),
)


def queue_family(model: str, stats: EngineStats) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "dgpp:num_requests_by_priority",
        "Requests now waiting for admission or running, by priority (lower runs first).",
        labels=[*LABELS, "state"],
    )
    for label, counts in sorted(stats.queues_by_priority.items()):
        for state, count in sorted(counts.items()):
            family.add_metric([model, label, state], count)
    return family


def latency_families(model: str, latencies: Latencies) -> Iterator[Metric]:
    for kind, name, what in HISTOGRAMS:
        family = HistogramMetricFamily(
            name, f"{what}, per finished choice, by priority (lower runs first).", labels=LABELS
        )
        for label, histogram in sorted(latencies.by_priority[kind].items()):
            buckets = [(floatToGoString(bound), count) for bound, count in histogram.cumulative()]
            family.add_metric([model, label], buckets, histogram.total)
        yield family
