"""The sampler's rates and the SQLite history behind the charts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dgpp.webui.monitor.engine_client import Health
from dgpp.webui.monitor.history import MAX_POINTS, HistoryStore, Sample
from dgpp.webui.monitor.metrics_poller import MetricsPoller, sample_of


def _metrics(tokens: int, prompt: int, hits: int, drafted: int = 0, accepted: int = 0) -> dict:
    return {
        "scheduler": {
            "tokens_generated": tokens,
            "prompt_tokens_total": prompt,
            "running": 2,
            "waiting": 1,
            "kv_blocks_in_use": 5,
            "kv_blocks_total": 80,
        },
        "prefix_cache": {"hit_tokens": hits, "ttft_avg_hit_s": 0.1, "ttft_avg_miss_s": None},
        "spec_decode": {"drafted": drafted, "accepted": accepted},
    }


def test_hits_are_split_by_the_tier_that_held_them() -> None:
    """Of 200 prompt tokens in the interval, 150 hit: 30 from disk (through the host tier), 50
    more from host memory, the other 70 still in the pool."""
    before = _metrics(10, 100, 0)
    now = _metrics(50, 300, 150)
    now["prefix_cache"] |= {"host_hit_tokens": 80, "disk_hit_tokens": 30}
    _, snapshot = sample_of(100.0, before, True, None)
    sample, _ = sample_of(102.0, now, True, snapshot)
    assert sample.prefix_hit_rate == pytest.approx(0.75)
    rates = (sample.prefix_device_rate, sample.prefix_host_rate, sample.prefix_disk_rate)
    assert rates == pytest.approx((0.35, 0.25, 0.15))


def test_rates_come_from_two_snapshots() -> None:
    first, snapshot = sample_of(100.0, _metrics(10, 100, 0), True, None)
    assert first.gen_tps is None and first.running == 2 and first.kv_total == 80
    second, snapshot = sample_of(102.0, _metrics(50, 300, 150, 10, 7), True, snapshot)
    assert second.gen_tps == pytest.approx(20.0)
    assert second.prompt_tps == pytest.approx(100.0)
    assert second.prefix_hit_rate == pytest.approx(0.75)
    assert second.spec_acceptance == pytest.approx(0.7)
    assert second.kv_used_pct == pytest.approx(6.25)  # 5 of 80 blocks
    # A counter going down means the engine restarted: no rate for that interval.
    third, _ = sample_of(104.0, _metrics(5, 20, 0), True, snapshot)
    assert third.gen_tps is None and third.prefix_hit_rate is None and third.running == 2


def test_image_rates_come_from_the_vision_counters() -> None:
    """In 2 s: 6 images admitted; the encoder ran on 4 (0.2 s in all), its cache held 2."""
    before, now = _metrics(10, 100, 0), _metrics(50, 300, 0)
    before["vision"] = {"images": 4, "encoded": 3, "encoder_seconds": 0.5, "encoder_cache_hits": 1}
    now["vision"] = {"images": 10, "encoded": 7, "encoder_seconds": 0.7, "encoder_cache_hits": 3}
    _, snapshot = sample_of(100.0, before, True, None)
    sample, _ = sample_of(102.0, now, True, snapshot)
    assert sample.images_rps == pytest.approx(3.0)
    assert sample.encoder_ms == pytest.approx(50.0)
    assert sample.image_cache_hit_rate == pytest.approx(2 / 6)
    text_only, _ = sample_of(104.0, _metrics(60, 320, 0), True, snapshot)  # no vision section
    assert text_only.encoder_ms is None and text_only.image_cache_hit_rate is None


def _with_classes(metrics: dict, short: tuple, long: tuple) -> dict:
    keys = ("requests", "queue_sum_s", "ttft_sum_s")
    return {
        **metrics,
        "prompt_classes": {
            "short": dict(zip(keys, short, strict=True)),
            "long": dict(zip(keys, long, strict=True)),
        },
    }


def test_latency_by_prompt_class_is_the_mean_since_the_previous_sample() -> None:
    _, snapshot = sample_of(
        100.0, _with_classes(_metrics(1, 1, 0), (4, 1.0, 2.0), (1, 0.5, 3.0)), True, None
    )
    now = _with_classes(_metrics(2, 2, 0), (6, 1.2, 2.6), (1, 0.5, 3.0))
    sample, _ = sample_of(102.0, now, True, snapshot)
    assert sample.queue_short_s == pytest.approx(0.1) and sample.ttft_short_s == pytest.approx(0.3)
    assert sample.queue_long_s is None and sample.ttft_long_s is None  # none since the last one
    # An engine without the split (older version) leaves the columns empty.
    plain, _ = sample_of(104.0, _metrics(3, 3, 0), True, snapshot)
    assert plain.ttft_short_s is None


def test_a_history_from_an_older_console_gains_the_new_columns(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "history.sqlite"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE samples (ts REAL NOT NULL, serving REAL, gen_tps REAL)")
    old.execute("INSERT INTO samples VALUES (50.0, 1, 3.0)")
    old.commit()
    old.close()
    store = HistoryStore(path, retention_s=1e9, max_rows=100)
    store.add(Sample(100.0, 1, gen_tps=5.0, ttft_short_s=0.2))
    series = store.series(window_s=1e9, now=101.0)
    store.close()
    assert series["gen_tps"] == [3.0, 5.0] and series["ttft_short_s"] == [None, 0.2]


def test_columns_no_longer_written_stay_in_an_older_history_unread(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "history.sqlite"
    old = sqlite3.connect(path)  # an older console charted the engine's TTFT means since start
    old.execute("CREATE TABLE samples (ts REAL NOT NULL, serving REAL, ttft_hit_s REAL)")
    old.execute("INSERT INTO samples VALUES (50.0, 1, 0.65)")
    old.commit()
    old.close()
    store = HistoryStore(path, retention_s=1e9, max_rows=100)
    store.add(Sample(100.0, 1, ttft_p95_s=0.4, kv_used_pct=12.5))
    series = store.series(window_s=1e9, now=101.0)
    store.close()
    assert "ttft_hit_s" not in series
    assert series["ttft_p95_s"] == [None, 0.4] and series["kv_used_pct"] == [None, 12.5]


def test_an_engine_down_is_a_gap(tmp_path: Path) -> None:
    sample, snapshot = sample_of(100.0, None, False, None)
    assert sample == Sample(100.0, 0) and snapshot is None


class _Engine:
    def __init__(self) -> None:
        self.tokens = 0

    async def health(self) -> Health:
        return Health(200, {"state": "serving"})

    async def metrics(self) -> dict:
        self.tokens += 30
        return _metrics(self.tokens, self.tokens * 2, 0)

    async def prometheus(self) -> None:
        return None  # an engine without /metrics: no percentiles, the rest as before


def test_the_sampler_stores_samples_that_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    store = HistoryStore(path, retention_s=3600, max_rows=1000)
    times = iter([1000.0, 1001.0, 1002.0])
    engine = _Engine()
    sampler = MetricsPoller(store, lambda: engine, 1.0, clock=lambda: next(times))  # type: ignore[arg-type, return-value]
    for _ in range(3):
        asyncio.run(sampler.tick())
    store.close()
    reopened = HistoryStore(path, retention_s=3600, max_rows=1000)
    series = reopened.series(window_s=60, now=1003.0)
    assert series["ts"] == [1000.0, 1001.0, 1002.0]
    assert series["gen_tps"] == [None, 30.0, 30.0]
    assert series["serving"] == [1, 1, 1]
    reopened.close()


def test_retention_and_the_row_limit_bound_the_history(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite", retention_s=100, max_rows=100)
    for second in range(300):
        store.add(Sample(float(second), 1, running=second))
    # Older than 100 s before the newest sample: gone.
    series = store.series(window_s=1000, now=300.0)
    assert series["ts"][0] >= 199.0 and series["ts"][-1] == 299.0
    assert store.count() <= 101
    store.close()


def test_long_windows_are_averaged_to_a_bounded_number_of_points(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite", retention_s=10**6, max_rows=10**6)
    for second in range(3 * MAX_POINTS):
        store.add(Sample(float(second), 1, running=1, waiting=None))
    series = store.series(window_s=3 * MAX_POINTS, now=3.0 * MAX_POINTS)
    assert len(series["ts"]) <= MAX_POINTS + 1
    assert set(series["running"]) == {1.0} and set(series["waiting"]) == {None}
    store.close()
