"""The Prometheus exposition of one app (GET /metrics), in its own `CollectorRegistry`.

One collector builds every family at scrape time: the engine's gauges and counters from an
`EngineStats` snapshot, the service counters and latency histograms of `ServiceMetrics`, and
rank 0's memory (`process_memory`). Every sample carries `model_name`. Names and units:
docs/metrics.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from dgpp.engine.scheduling.stats import EngineStats, PrefixCacheCounters
from dgpp.engine.server.metrics import priority_families
from dgpp.engine.server.metrics.histogram import Histogram
from dgpp.engine.server.metrics.process_memory import MemoryReading, read_memory
from dgpp.engine.server.metrics.service import ServiceMetrics
from dgpp.engine.server.metrics.side_families import side_families

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ["model_name"]


class DgppCollector(Collector):
    """`model_name()` labels every sample; `stats()` is the engine's snapshot, or None while the
    model loads (the engine families are left out then); `memory()` reads this process."""

    def __init__(
        self,
        metrics: ServiceMetrics,
        model_name: Callable[[], str],
        stats: Callable[[], EngineStats | None],
        memory: Callable[[], MemoryReading] = read_memory,
        sides: Callable[[], list[dict[str, Any]]] = list,
    ) -> None:
        """`sides`: the side models' /v1/models cards (none by default)."""
        self.metrics = metrics
        self.sides = sides
        self.model_name = model_name
        self.stats = stats
        self.memory = memory

    def collect(self) -> Iterator[Metric]:
        model = self.model_name()
        try:
            stats = self.stats()
        except Exception:  # a broken engine must not take the service counters down with it
            log.warning("engine stats unavailable for /metrics", exc_info=True)
            stats = None
        if stats is not None:
            yield from _engine_families(model, stats)
            yield priority_families.queue_family(model, stats)
        yield from _service_families(model, self.metrics)
        yield from _latency_families(model, self.metrics)
        yield from priority_families.latency_families(model, self.metrics.latencies())
        yield from _memory_families(model, self.memory())
        yield from side_families(self.sides())


def build_registry(
    metrics: ServiceMetrics,
    model_name: Callable[[], str],
    stats: Callable[[], EngineStats | None],
    sides: Callable[[], list[dict[str, Any]]] = list,
) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(DgppCollector(metrics, model_name, stats, sides=sides))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=LABELS)
    family.add_metric([model], value)
    return family


def _counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=LABELS)  # exposed as `name` + "_total"
    family.add_metric([model], value)
    return family


def _tier_hits(model: str, cache: PrefixCacheCounters) -> CounterMetricFamily:
    """Prefix-cache hit tokens by the tier that held them: still on the device, loaded back
    from host memory, or read back from disk (through the host tier)."""
    family = CounterMetricFamily(
        "dgpp:prefix_cache_tier_hits",
        "Prompt tokens whose KV came from the prefix cache, by tier (tokens).",
        labels=[*LABELS, "tier"],
    )
    host = cache.host_hit_tokens - cache.disk_hit_tokens
    family.add_metric([model, "device"], cache.hit_tokens - cache.host_hit_tokens)
    family.add_metric([model, "host"], host)
    family.add_metric([model, "disk"], cache.disk_hit_tokens)
    return family


def _kernel_fallbacks(model: str, stats: EngineStats) -> GaugeMetricFamily:
    """1 for each Triton kernel the start-up self-check switched off (its twin serves), 0 for
    each that passed; CUDA graphs among them (no series where no check ran: CPU ranks)."""
    family = GaugeMetricFamily(
        "dgpp:kernel_fallback",
        "1 where the start-up self-check switched a kernel off for its PyTorch twin, else 0.",
        labels=[*LABELS, "kernel"],
    )
    for kernel, state in sorted(stats.kernels.items()):
        family.add_metric([model, kernel], float(state != "ok"))
    return family


def _engine_families(model: str, stats: EngineStats) -> Iterator[Metric]:
    counters = stats.counters
    yield _kernel_fallbacks(model, stats)
    yield _gauge(
        "dgpp:num_requests_running", "Requests in the running batch.", model, stats.running
    )
    yield _gauge(
        "dgpp:num_requests_waiting", "Requests queued for admission.", model, stats.waiting
    )
    yield _gauge(
        "dgpp:kv_cache_usage_perc",
        "Fraction of KV-cache blocks in use (1 = full).",
        model,
        stats.kv_usage,
    )
    yield _counter(
        "dgpp:prefix_cache_queries",
        "Prompt tokens of admitted requests, each one a prefix-cache query (tokens).",
        model,
        counters.prompt_tokens_total,
    )
    yield _counter(
        "dgpp:prefix_cache_hits",
        "Prompt tokens whose KV came from the prefix cache (tokens).",
        model,
        counters.prefix_cache.hit_tokens,
    )
    yield _tier_hits(model, counters.prefix_cache)
    yield _counter(
        "dgpp:prompt_tokens",
        "Prompt tokens of admitted requests.",
        model,
        counters.prompt_tokens_total,
    )
    yield _counter(
        "dgpp:generation_tokens",
        "Tokens generated by the engine.",
        model,
        counters.tokens_generated,
    )
    if stats.snapshots is not None:  # hybrid models: recurrent-state snapshots
        yield _gauge(
            "dgpp:state_snapshots",
            "Recurrent-state snapshots the prefix cache holds.",
            model,
            stats.snapshots.held,
        )
        yield _gauge(
            "dgpp:state_snapshot_bytes",
            "Bytes of the recurrent-state snapshots held (per rank).",
            model,
            stats.snapshots.bytes_held,
        )
        yield _counter(
            "dgpp:state_snapshot_hits",
            "Prefix-cache hits that restored a recurrent-state snapshot.",
            model,
            stats.snapshots.hits,
        )
    yield from _step_model_families(model, stats.step_model)
    yield from _vision_families(model, stats)
    spec = counters.spec_decode
    yield _counter(
        "dgpp:spec_decode_num_drafts",
        "Verify rows that carried at least one speculative draft token.",
        model,
        spec.drafts,
    )
    yield _counter(
        "dgpp:spec_decode_num_draft_tokens",
        "Speculative draft tokens proposed (tokens).",
        model,
        spec.draft_tokens,
    )
    yield _counter(
        "dgpp:spec_decode_num_accepted_tokens",
        "Speculative draft tokens accepted (tokens).",
        model,
        spec.accepted_tokens,
    )
    per_position = CounterMetricFamily(
        "dgpp:spec_decode_num_accepted_tokens_per_pos",
        "Speculative draft tokens accepted at each draft position (0 = first) (tokens).",
        labels=[*LABELS, "position"],
    )
    accepted = spec.accepted_per_position
    for position in range(max(stats.spec_depth, len(accepted))):  # 0 until a position accepts
        count = accepted[position] if position < len(accepted) else 0
        per_position.add_metric([model, str(position)], count)
    yield per_position
    yield _counter(
        "dgpp:num_preemptions",
        "Requests preempted to free KV blocks.",
        model,
        counters.num_preemptions,
    )


STEP_MODEL_GAUGES = (
    ("dgpp:step_model_decode_step_seconds", "decode_step_s", "A decode-only step (the base)."),
    ("dgpp:step_model_prompt_token_seconds", "token_s", "A prompt token's cost at position 0."),
    (
        "dgpp:step_model_prompt_token_position_seconds",
        "token_position_s",
        "What a prompt token costs more per earlier position it attends over.",
    ),
    (
        "dgpp:step_model_solo_short_seconds",
        "solo_short_s",
        "A typical short request's first-token step alone: an arrival's wait is sized on it.",
    ),
)


def _vision_families(model: str, stats: EngineStats) -> Iterator[Metric]:
    """Images of a vision-language model's prompts, and its encoder's work (rank 0)."""
    vision = stats.counters.vision
    for name, doc, value in (
        ("vision_requests", "Admitted requests with images.", vision.requests),
        ("vision_images", "Images in admitted prompts.", vision.images),
        ("vision_tokens", "Vision tokens of those images (prompt tokens).", vision.tokens),
        ("vision_images_encoded", "Images the vision encoder ran on.", vision.encoded),
        ("vision_encoder_seconds", "Time the vision encoder took (s).", vision.encoder_seconds),
        (
            "vision_encoder_cache_hits",
            "Images read from the encoder cache instead of encoded again.",
            vision.cache_hits,
        ),
    ):
        yield _counter(f"dgpp:{name}", doc, model, value)


def _step_model_families(model: str, step_model: dict[str, float | None]) -> Iterator[Metric]:
    """The step-time model's fitted constants, once fitted (the interactive step policy)."""
    for name, key, doc in STEP_MODEL_GAUGES:
        if (value := step_model.get(key)) is not None:
            yield _gauge(name, f"Step-time model: {doc} (seconds)", model, value)


SERVICE_COUNTERS = (
    ("dgpp:requests", "requests_total", "API generation requests with a known outcome."),
    ("dgpp:request_success", "succeeded", "API generation requests answered in full."),
    ("dgpp:request_failure", "failed", "API generation requests failed by the server (5xx)."),
    ("dgpp:request_cancelled", "cancelled", "API generation requests the client abandoned."),
    ("dgpp:request_shed", "shed", "API generation requests refused as overloaded (503)."),
    ("dgpp:request_rejected", "rejected", "API generation requests refused as invalid (4xx)."),
    ("dgpp:output_tokens", "tokens_out", "Completion tokens of finished choices sent to clients."),
    ("dgpp:tool_calls", "tool_calls_out", "Tool calls parsed out of answers sent to clients."),
)


def _memory_families(model: str, memory: MemoryReading) -> Iterator[Metric]:
    yield _gauge(
        "dgpp:process_resident_memory_bytes",
        "Resident host memory of rank 0's process (bytes).",
        model,
        memory.host_rss_bytes,
    )
    device = (
        (
            "dgpp:device_memory_allocated_bytes",
            "Device memory held by live tensors on rank 0 (bytes).",
            memory.device_allocated_bytes,
        ),
        (
            "dgpp:device_memory_reserved_bytes",
            "Device memory held by rank 0's caching allocator, allocated or not (bytes).",
            memory.device_reserved_bytes,
        ),
        (
            "dgpp:device_memory_total_bytes",
            "Total memory of the devices rank 0 holds memory on (bytes).",
            memory.device_total_bytes,
        ),
    )
    for name, doc, value in device:
        if value is not None:  # CUDA only: a CPU engine has no device memory to report
            yield _gauge(name, doc, model, value)


def _service_families(model: str, metrics: ServiceMetrics) -> Iterator[Metric]:
    counters = metrics.counters()
    for name, field, doc in SERVICE_COUNTERS:
        yield _counter(name, doc, model, getattr(counters, field))


def _histogram(family: HistogramMetricFamily, labels: list[str], histogram: Histogram) -> None:
    buckets = [(floatToGoString(bound), count) for bound, count in histogram.cumulative()]
    family.add_metric(labels, buckets, histogram.total)


def _latency_families(model: str, metrics: ServiceMetrics) -> Iterator[Metric]:
    lat = metrics.latencies()
    ttft = HistogramMetricFamily(
        "dgpp:time_to_first_token_seconds",
        "Arrival to first generated token, per finished choice; cache=hit when part of the "
        "prompt came from the prefix cache.",
        labels=[*LABELS, "cache"],
    )
    _histogram(ttft, [model, "hit"], lat.ttft_hit)
    _histogram(ttft, [model, "miss"], lat.ttft_miss)
    yield ttft
    singles = (
        (
            "dgpp:inter_token_latency_seconds",
            "Mean gap between generated tokens of a finished choice, counted once per gap.",
            lat.inter_token,
        ),
        (
            "dgpp:e2e_request_latency_seconds",
            "Arrival to finish, per finished choice.",
            lat.e2e,
        ),
        (
            "dgpp:request_queue_time_seconds",
            "Arrival to first scheduled, per finished choice.",
            lat.queue,
        ),
    )
    for name, doc, histogram in singles:
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        _histogram(family, [model], histogram)
        yield family
    by_class = (
        (
            "dgpp:time_to_first_token_by_prompt_class_seconds",
            "Arrival to first generated token, per finished choice, by prompt class: short when "
            "the prefill it needed (after any cache hit) was at most short_prompt_tokens.",
            lat.ttft_by_class,
        ),
        (
            "dgpp:request_queue_time_by_prompt_class_seconds",
            "Arrival to first scheduled, per finished choice, by prompt class (as above).",
            lat.queue_by_class,
        ),
    )
    for name, doc, histograms in by_class:
        family = HistogramMetricFamily(name, doc, labels=[*LABELS, "prompt_class"])
        for prompt_class, histogram in histograms.items():
            _histogram(family, [model, prompt_class], histogram)
        yield family
