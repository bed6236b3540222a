"""Per-interval values the sampler derives: latency quantiles from the deltas of the engine's
Prometheus histograms, request-outcome rates, KV use in percent, and rank 0's memory."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput, RequestTimings
from dgpp.engine.server.metrics.prometheus import build_registry, render
from dgpp.engine.server.metrics.service import Outcome, ServiceMetrics
from dgpp.webui.monitor.engine_client import Health
from dgpp.webui.monitor.history import HistoryStore
from dgpp.webui.monitor.latency_histogram import LATENCY_FAMILIES, Buckets, read_histograms
from dgpp.webui.monitor.metrics_poller import MetricsPoller, sample_of

INF = math.inf


def test_a_quantile_interpolates_inside_the_bucket_that_holds_its_rank() -> None:
    # 10 observations at or below 0.1 s, 10 in (0.1, 1], none above.
    buckets = Buckets((0.1, 1.0, INF), (10, 20, 20))
    assert buckets.quantile(0.5) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert buckets.quantile(0.95) == pytest.approx(0.1 + 0.9 * 9 / 10)  # rank 19 of (0.1, 1]
    # The first bucket starts at 0; a rank in +Inf answers the largest finite bound.
    assert Buckets((0.1, 1.0, INF), (4, 4, 4)).quantile(0.5) == pytest.approx(0.05)
    assert Buckets((0.1, 1.0, INF), (0, 1, 10)).quantile(0.5) == 1.0
    assert Buckets((0.1, 1.0, INF), (0, 0, 0)).quantile(0.5) is None  # nothing observed


def test_an_interval_is_the_difference_of_two_readings() -> None:
    before = Buckets((0.1, 1.0, INF), (5, 5, 5))
    after = Buckets((0.1, 1.0, INF), (5, 9, 9))
    interval = after.since(before)
    assert interval == Buckets((0.1, 1.0, INF), (0, 4, 4))
    assert interval is not None and interval.quantile(0.5) == pytest.approx(0.55)
    empty = before.since(before)
    assert empty is not None and empty.quantile(0.95) is None
    # A count that went down: the engine restarted in between; nothing compares.
    assert Buckets((0.1, 1.0, INF), (1, 1, 1)).since(before) is None
    assert Buckets((0.5, 1.0, INF), (5, 5, 5)).since(before) is None  # other bounds


def _finished(ttft: float, e2e: float, tokens: int, cached: int = 0) -> RequestOutput:
    """One finished choice with these latencies (arrival at 0): its inter-token gap is
    (e2e - ttft) / (tokens - 1), observed tokens - 1 times."""
    timings = RequestTimings(arrival=0.0, first_scheduled=0.0, first_token=ttft, finished=e2e)
    completion = CompletionOutput(0, "x", tuple(range(tokens)), "stop")
    return RequestOutput(
        "r", None, (1,), (completion,), True, num_cached_tokens=cached, timings=timings
    )


def _exposition(service: ServiceMetrics) -> str:
    """`/metrics` as the engine's own collector writes it."""
    return render(build_registry(service, lambda: "m", lambda: None)).decode()


def _metrics(**service: int) -> dict[str, Any]:
    return {"scheduler": {"kv_blocks_in_use": 1, "kv_blocks_total": 4}, "service": service}


def test_latency_percentiles_are_those_of_the_interval_from_the_engines_histograms() -> None:
    service = ServiceMetrics()
    for _ in range(5):  # before the first sample: not in any interval
        service.record_finished(_finished(ttft=0.3, e2e=9.0, tokens=2))
    _, snapshot = sample_of(100.0, _metrics(), True, None, _exposition(service))
    for cached in (0, 32, 0, 32, 0, 32, 0, 32, 0):  # hits and misses are summed
        service.record_finished(_finished(ttft=0.03, e2e=1.03, tokens=11, cached=cached))
    service.record_finished(_finished(ttft=3.0, e2e=4.0, tokens=11))
    sample, snapshot = sample_of(102.0, _metrics(), True, snapshot, _exposition(service))
    # TTFT: 9 in (0.02, 0.04], 1 in (2.5, 5] (engine/server/metrics/histogram.py's bounds).
    assert sample.ttft_p50_s == pytest.approx(0.02 + 0.02 * 5 / 9)
    assert sample.ttft_p95_s == pytest.approx(2.5 + 2.5 * 0.5)
    # Inter-token: 10 choices x 10 gaps of 0.1 s, all in (0.075, 0.1].
    assert sample.itl_p50_s == pytest.approx(0.075 + 0.025 * 0.5)
    assert sample.itl_p95_s == pytest.approx(0.075 + 0.025 * 0.95)
    # End to end: 9 in (1.0, 1.5], 1 in (2.5, 5].
    assert sample.e2e_p50_s == pytest.approx(1.0 + 0.5 * 5 / 9)
    assert sample.e2e_p95_s == pytest.approx(3.75)
    # Nothing finished since: no percentile (not the previous one, not 0).
    quiet, snapshot = sample_of(104.0, _metrics(), True, snapshot, _exposition(service))
    assert (quiet.ttft_p50_s, quiet.itl_p95_s, quiet.e2e_p95_s) == (None, None, None)
    # The engine restarted (a fresh server with fewer observations): that interval has none.
    restarted = ServiceMetrics()
    restarted.record_finished(_finished(ttft=0.3, e2e=1.0, tokens=2))
    after, snapshot = sample_of(106.0, _metrics(), True, snapshot, _exposition(restarted))
    assert after.ttft_p50_s is None and after.e2e_p95_s is None
    # ... and the next interval of the new server has its own.
    restarted.record_finished(_finished(ttft=0.3, e2e=1.0, tokens=2))
    later, _ = sample_of(108.0, _metrics(), True, snapshot, _exposition(restarted))
    assert later.ttft_p50_s == pytest.approx(0.25 + 0.25 * 0.5)


def test_the_exposition_is_read_with_every_label_summed() -> None:
    service = ServiceMetrics()
    service.record_finished(_finished(ttft=0.03, e2e=1.0, tokens=2, cached=8))
    service.record_finished(_finished(ttft=0.03, e2e=1.0, tokens=2))
    histograms = read_histograms(_exposition(service), LATENCY_FAMILIES.values())
    assert set(histograms) == set(LATENCY_FAMILIES.values())
    ttft = histograms["dgpp:time_to_first_token_seconds"]
    assert ttft.total == 2 and ttft.bounds[-1] == INF
    assert read_histograms("not prometheus {", LATENCY_FAMILIES.values()) == {}
    # Without /metrics (not read, or an older engine) there are no percentiles.
    _, snapshot = sample_of(1.0, _metrics(), True, None)
    sample, _ = sample_of(2.0, _metrics(), True, snapshot, _exposition(service))
    assert sample.ttft_p50_s is None


def test_request_outcomes_are_rates_per_second_between_two_samples() -> None:
    counts = {"succeeded": 10, "failed": 0, "shed": 0, "cancelled": 1, "rejected": 3}
    first, snapshot = sample_of(100.0, _metrics(**counts), True, None)
    assert first.succeeded_rps is None  # one snapshot: nothing to compare with
    later = {"succeeded": 30, "failed": 2, "shed": 4, "cancelled": 1, "rejected": 4}
    second, snapshot = sample_of(102.0, _metrics(**later), True, snapshot)
    assert (second.succeeded_rps, second.failed_rps, second.shed_rps) == (10.0, 1.0, 2.0)
    assert (second.cancelled_rps, second.rejected_rps) == (0.0, 0.5)
    # The engine restarted: its counters start again from 0.
    third, _ = sample_of(104.0, _metrics(succeeded=1), True, snapshot)
    assert third.succeeded_rps is None and third.failed_rps is None


def test_kv_use_is_a_percentage_of_the_pool_with_its_token_capacity() -> None:
    scheduler = {"kv_blocks_in_use": 16, "kv_blocks_total": 64, "kv_block_size": 16}
    sample, _ = sample_of(1.0, {"scheduler": {**scheduler, "kv_tokens_total": 1024}}, True, None)
    assert (sample.kv_used_pct, sample.kv_tokens_total) == (25.0, 1024)
    assert (sample.kv_in_use, sample.kv_total) == (16, 64)
    # An engine that gives the block size only: the capacity is blocks x block size.
    sample, _ = sample_of(1.0, {"scheduler": scheduler}, True, None)
    assert sample.kv_tokens_total == 1024
    # An older engine says neither; an empty pool has no percentage.
    older = {"kv_blocks_in_use": 0, "kv_blocks_total": 0}
    sample, _ = sample_of(1.0, {"scheduler": older}, True, None)
    assert (sample.kv_used_pct, sample.kv_tokens_total) == (None, None)


def test_memory_is_rank_0s_reading_at_the_sampling_instant() -> None:
    memory = {
        "host_rss_bytes": 3 << 30,
        "device_allocated_bytes": 20 << 30,
        "device_reserved_bytes": 24 << 30,
        "device_total_bytes": 128 << 30,
    }
    sample, _ = sample_of(1.0, {"memory": memory}, True, None)
    assert sample.host_rss_bytes == 3 << 30 and sample.device_reserved_bytes == 24 << 30
    assert sample.device_allocated_bytes == 20 << 30 and sample.device_total_bytes == 128 << 30
    cpu = {**memory, "device_allocated_bytes": None, "device_reserved_bytes": None}
    sample, _ = sample_of(1.0, {"memory": {**cpu, "device_total_bytes": None}}, True, None)
    assert sample.host_rss_bytes == 3 << 30 and sample.device_total_bytes is None


class _Engine:
    """Serving, with one more finished request (TTFT 0.3 s) at every read of /metrics."""

    def __init__(self) -> None:
        self.service = ServiceMetrics()

    async def health(self) -> Health:
        return Health(200, {"state": "serving"})

    async def metrics(self) -> dict[str, Any]:
        self.service.record_outcome(Outcome.SUCCEEDED)
        return {"service": {"succeeded": self.service.counters().succeeded}}

    async def prometheus(self) -> str:
        self.service.record_finished(_finished(ttft=0.3, e2e=1.0, tokens=2))
        return _exposition(self.service)


def test_the_sampler_reads_both_metrics_of_the_engine(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "history.sqlite", retention_s=3600, max_rows=100)
    times = iter([1000.0, 1001.0, 1002.0])
    engine = _Engine()
    sampler = MetricsPoller(store, lambda: engine, 1.0, clock=lambda: next(times))  # type: ignore[arg-type, return-value]
    for _ in range(3):
        asyncio.run(sampler.tick())
    series = store.series(window_s=60, now=1003.0)
    store.close()
    assert series["succeeded_rps"] == [None, 1.0, 1.0]
    # One observation per interval, in (0.25, 0.5]: its middle is the median.
    assert series["ttft_p50_s"] == [None, pytest.approx(0.375), pytest.approx(0.375)]


class _WithSides(_Engine):
    """The main engine beside a loaded side model "emb" (2 tokens a read) and an unloaded "rr";
    "emb" stops answering at its third read (unloaded meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.side_reads = 0
        self.asked: list[str | None] = []

    async def metrics(self, model: str | None = None) -> dict[str, Any] | None:
        self.asked.append(model)
        if model is None:
            main = await super().metrics()
            cards = [{"id": "emb", "state": "loaded"}, {"id": "rr", "state": "unloaded"}]
            return {**main, "side_models": cards}
        self.side_reads += 1
        if self.side_reads > 2:
            return None
        return {"scheduler": {"tokens_generated": 2 * self.side_reads}}

    async def prometheus(self, model: str | None = None) -> str:
        return await super().prometheus() if model is None else ""


def test_each_loaded_side_model_has_its_own_history(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "history.sqlite", retention_s=3600, max_rows=100)
    times = iter([1000.0, 1001.0, 1002.0])
    engine = _WithSides()
    sampler = MetricsPoller(store, lambda: engine, 1.0, clock=lambda: next(times))  # type: ignore[arg-type, return-value]
    for _ in range(3):
        asyncio.run(sampler.tick())
    main = store.series(window_s=60, now=1003.0)
    side = store.series(window_s=60, now=1003.0, model="emb")
    assert store.models() == ["emb"]
    store.close()
    assert main["succeeded_rps"] == [None, 1.0, 1.0]  # the main model's rows only
    assert side["ts"] == [1000.0, 1001.0] and side["gen_tps"] == [None, 2.0]
    assert "rr" not in engine.asked  # an unloaded side model is never asked (nor loaded)
