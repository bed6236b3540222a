"""The metrics building blocks without a server: histogram buckets, outcomes, the per-request
tracker, and the stats log line."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import replace

import pytest

from dgpp.engine.scheduling.stats import EngineCounters, EngineStats, PrefixCacheCounters
from dgpp.engine.server.metrics.histogram import Histogram
from dgpp.engine.server.metrics.service import (
    Outcome,
    RequestTracker,
    ServiceCounters,
    ServiceMetrics,
    outcome_of,
    request_tracker,
)
from dgpp.engine.server.metrics.stats_log import Sample, StatsLine, periodic_stats_log

STATS_LOGGER = "dgpp.engine.server.metrics.stats_log"


def _stats(
    prompt: int = 0, generated: int = 0, hit: int = 0, running: int = 0, cache: bool = True
) -> EngineStats:
    counters = EngineCounters(
        tokens_generated=generated,
        prompt_tokens_total=prompt,
        prefix_cache=PrefixCacheCounters(hit_tokens=hit),
    )
    return EngineStats(
        running=running,
        waiting=0,
        prefilling=0,
        kv_blocks_total=8,
        kv_blocks_in_use=2,
        block_size=16,
        prefix_cache_enabled=cache,
        prefix_min_tokens=0,
        counters=counters,
    )


def test_histogram_buckets_are_inclusive_and_cumulative() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.1, 0.5, 1.0, 7.0):
        histogram.observe(value)
    histogram.observe(0.05, weight=3)
    assert histogram.cumulative() == [(0.1, 4), (1.0, 6), (math.inf, 7)]
    assert (histogram.count, histogram.total) == (7, pytest.approx(8.75))
    copy = histogram.copy()
    histogram.observe(0.0)
    assert copy.count == 7 and copy.counts != histogram.counts


@pytest.mark.parametrize(
    ("status", "code", "outcome"),
    [
        (503, "overloaded", Outcome.SHED),
        (503, "engine_failure", Outcome.FAILED),
        (503, "starting", Outcome.FAILED),
        (500, "internal_error", Outcome.FAILED),
        (400, "invalid_json", Outcome.REJECTED),
        (401, "invalid_api_key", Outcome.REJECTED),
        (404, "model_not_found", Outcome.REJECTED),
        (200, None, Outcome.SUCCEEDED),
    ],
)
def test_outcome_of_an_error(status: int, code: str | None, outcome: Outcome) -> None:
    assert outcome_of(status, code) is outcome


def test_the_first_outcome_of_a_request_wins() -> None:
    metrics = ServiceMetrics()
    tracker = RequestTracker(metrics)
    tracker.finish(Outcome.SUCCEEDED)
    tracker.finish(Outcome.FAILED)
    tracker.tool_calls(2)
    assert metrics.counters() == ServiceCounters(requests_total=1, succeeded=1, tool_calls_out=2)


def test_one_tracker_per_scope_and_only_on_generation_routes() -> None:
    app = type("App", (), {"state": type("S", (), {"dgpp_metrics": ServiceMetrics()})()})()
    scope = {"type": "http", "path": "/v1/chat/completions", "app": app, "state": {}}
    tracker = request_tracker(scope)
    assert tracker is not None and request_tracker(scope) is tracker
    assert request_tracker({**scope, "path": "/v1/models", "state": {}}) is None
    assert request_tracker({**scope, "state": {}, "app": object()}) is None


def _sample(at: float, stats: EngineStats | None, requests: int = 0) -> Sample:
    return Sample(at, stats, ServiceCounters(requests_total=requests))


def test_stats_line_reports_rates_since_the_last_line() -> None:
    line = StatsLine(_sample(0.0, _stats(prompt=100, generated=10, hit=0)))
    text = line.next(_sample(2.0, _stats(prompt=300, generated=50, hit=50, running=1), 2))
    assert text == (
        "prompt 100.0 tok/s, generation 20.0 tok/s, running 1, waiting 0, KV cache 25.0% used, "
        "prefix cache hit rate 25.0%, 2 requests done"
    )


def test_stats_line_is_quiet_without_activity() -> None:
    line = StatsLine(_sample(0.0, _stats(prompt=100)))
    assert line.next(_sample(1.0, _stats(prompt=100))) is None
    assert line.next(_sample(2.0, None)) is None  # still loading
    off = line.next(_sample(3.0, _stats(prompt=100, cache=False), requests=1))
    assert off is not None and "prefix cache hit rate off, 1 requests done" in off
    busy = line.next(_sample(4.0, _stats(prompt=100, running=2, cache=True), requests=1))
    assert busy is not None and "running 2" in busy and "hit rate -" in busy


def test_periodic_log_logs_after_activity_and_stops(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    stats = _stats()

    def snapshot() -> EngineStats:
        return stats

    async def scenario() -> None:
        nonlocal stats
        async with periodic_stats_log(0.02, snapshot, ServiceCounters):
            await asyncio.sleep(0.1)  # idle: nothing logged
            assert not caplog.records
            stats = replace(stats, counters=replace(stats.counters, tokens_generated=5))
            for _ in range(500):  # a tick within 5 s, however loaded the machine
                if caplog.records:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # further ticks: nothing new, nothing logged
        count = len(caplog.records)
        await asyncio.sleep(0.05)
        assert len(caplog.records) == count  # the task stopped with the context

    asyncio.run(scenario())
    messages = [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER]
    assert len(messages) == 1 and "generation" in messages[0]


def test_periodic_log_off_at_zero() -> None:
    async def scenario() -> None:
        before = len(asyncio.all_tasks())
        async with periodic_stats_log(0, lambda: None, ServiceCounters):
            assert len(asyncio.all_tasks()) == before

    asyncio.run(scenario())
