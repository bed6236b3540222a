"""The metric history behind the console's charts: one row per sample in SQLite, so charts
survive a console restart and a model switch. The main model's rows have the model "", a
loaded side model's its name (`model`): the charts show one model at a time. Rows older than
the retention, and the oldest rows beyond `max_rows`, are deleted as new ones arrive. A history
written by an older console gains the newer columns, empty; columns this one no longer writes
(the engine's TTFT means since start) stay in the file, unread."""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

MAX_POINTS = 720  # a chart never gets more points than this; longer windows are averaged


@dataclass(frozen=True)
class Sample:
    """One sampling instant. None: not known then (engine down, or nothing to divide by)."""

    ts: float  # wall clock, seconds since the epoch
    serving: int  # 1 when /health said serving
    gen_tps: float | None = None  # generated tokens per second since the previous sample
    prompt_tps: float | None = None  # prompt tokens admitted per second
    prefix_hit_rate: float | None = None  # hit tokens / prompt tokens since the previous sample
    # Of those, by the tier that held them: the KV pool, host memory, disk (docs/runtime.md).
    prefix_device_rate: float | None = None
    prefix_host_rate: float | None = None
    prefix_disk_rate: float | None = None
    kv_in_use: int | None = None  # KV blocks held by requests
    kv_total: int | None = None
    kv_used_pct: float | None = None  # kv_in_use / kv_total, in percent
    kv_tokens_total: int | None = None  # the KV pool's token capacity
    running: int | None = None
    waiting: int | None = None
    spec_acceptance: float | None = None  # accepted / drafted tokens since the previous sample
    # Vision-language models, since the previous sample: images in admitted prompts per second,
    # the encoder's mean time per image it ran on, and the share of images its cache held.
    images_rps: float | None = None
    encoder_ms: float | None = None
    image_cache_hit_rate: float | None = None
    # Mean queue time and TTFT, by prompt class, of requests first answered since the previous one.
    queue_short_s: float | None = None
    queue_long_s: float | None = None
    ttft_short_s: float | None = None
    ttft_long_s: float | None = None
    # p50 / p95 of the observations between the previous sample and this one (latency_histogram).
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p95_s: float | None = None
    # API requests per second since the previous sample, by outcome (docs/metrics.md, service).
    succeeded_rps: float | None = None
    failed_rps: float | None = None
    shed_rps: float | None = None  # refused: 503 overloaded
    cancelled_rps: float | None = None
    rejected_rps: float | None = None
    # Rank 0's memory at this instant, bytes; the device ones None on CPU.
    host_rss_bytes: int | None = None
    device_allocated_bytes: int | None = None
    device_reserved_bytes: int | None = None
    device_total_bytes: int | None = None


COLUMNS = tuple(f.name for f in fields(Sample))


class HistoryStore:
    def __init__(self, path: Path, retention_s: float, max_rows: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.retention_s = retention_s
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._inserts = 0
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        columns = ", ".join(
            f"{name} REAL" if name != "ts" else "ts REAL NOT NULL" for name in COLUMNS
        )
        self._db.execute(f"CREATE TABLE IF NOT EXISTS samples ({columns}, model TEXT)")
        # A history written by an older console lacks the newer columns: add them (empty; an
        # older row's model is the main one).
        present = {row[1] for row in self._db.execute("PRAGMA table_info(samples)")}
        for name in COLUMNS:
            if name not in present:
                self._db.execute(f"ALTER TABLE samples ADD COLUMN {name} REAL")
        if "model" not in present:
            self._db.execute("ALTER TABLE samples ADD COLUMN model TEXT")
        self._db.execute("CREATE INDEX IF NOT EXISTS samples_ts ON samples (ts)")
        self._db.execute("CREATE INDEX IF NOT EXISTS samples_model ON samples (model, ts)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add(self, sample: Sample, model: str = "") -> None:
        """Store `sample` of `model` ("": the main model; else a side model's name)."""
        marks = ", ".join("?" for _ in (*COLUMNS, model))
        with self._lock:
            self._db.execute(
                f"INSERT INTO samples ({', '.join(COLUMNS)}, model) VALUES ({marks})",
                (*astuple(sample), model),
            )
            self._db.execute("DELETE FROM samples WHERE ts < ?", (sample.ts - self.retention_s,))
            self._inserts += 1
            if self._inserts % 100 == 1:
                self._db.execute(
                    "DELETE FROM samples WHERE ts < (SELECT ts FROM samples ORDER BY ts DESC "
                    "LIMIT 1 OFFSET ?)",
                    (self.max_rows - 1,),
                )

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0])

    def models(self) -> list[str]:
        """The side models with rows (the main model's, "", is always charted)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT model FROM samples WHERE model IS NOT NULL AND model != '' "
                "ORDER BY model"
            ).fetchall()
        return [str(row[0]) for row in rows]

    def series(
        self, window_s: float, now: float | None = None, model: str = ""
    ) -> dict[str, list[Any]]:
        """Columns (uPlot's data layout) of `model`'s last `window_s` seconds, at most
        `MAX_POINTS` rows: longer windows are averaged over equal time buckets."""
        now = time.time() if now is None else now
        since = now - window_s
        bucket = window_s / MAX_POINTS
        which = "ts >= ? AND COALESCE(model, '') = ?"
        with self._lock:
            count = self._db.execute(
                f"SELECT COUNT(*) FROM samples WHERE {which}", (since, model)
            ).fetchone()[0]
            if count <= MAX_POINTS:
                rows = self._db.execute(
                    f"SELECT {', '.join(COLUMNS)} FROM samples WHERE {which} ORDER BY ts",
                    (since, model),
                ).fetchall()
            else:
                averages = ", ".join(f"AVG({name})" for name in COLUMNS)
                rows = self._db.execute(
                    f"SELECT {averages} FROM samples WHERE {which} "
                    "GROUP BY CAST((ts - ?) / ? AS INTEGER) ORDER BY 1",
                    (since, model, since, bucket),
                ).fetchall()
        return {name: [row[index] for row in rows] for index, name in enumerate(COLUMNS)}
