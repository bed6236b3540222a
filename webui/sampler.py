"""Samples the engine's `/v1/metrics` every few seconds into the history.

Rates come from the difference of two snapshots of the engine's cumulative counters; a counter
that went down means the engine restarted, and that interval has no rate. TTFT is the engine's
own running mean for requests with and without a prefix-cache hit (docs/metrics.md); queue time
and TTFT by prompt class (short / long) are means over the requests that got their first token
since the previous sample."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dgpp.webui.engine_client import EngineApi
from dgpp.webui.history import HistoryStore, Sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    ts: float
    tokens_generated: int
    prompt_tokens: int
    hit_tokens: int
    drafted: int
    accepted: int
    # Per prompt class: (requests, queue seconds summed, TTFT seconds summed).
    classes: dict[str, tuple[int, float, float]]


def _classes(metrics: dict[str, Any]) -> dict[str, tuple[int, float, float]]:
    out: dict[str, tuple[int, float, float]] = {}
    for name, entry in (metrics.get("prompt_classes") or {}).items():
        if isinstance(entry, dict):
            out[name] = (
                int(entry.get("requests", 0)),
                float(entry.get("queue_sum_s", 0.0)),
                float(entry.get("ttft_sum_s", 0.0)),
            )
    return out


def _class_means(now: Snapshot, before: Snapshot) -> dict[str, float | None]:
    """Mean queue time and TTFT per class over the requests counted between two snapshots."""
    means: dict[str, float | None] = {}
    for name in ("short", "long"):
        count, queue, ttft = now.classes.get(name, (0, 0.0, 0.0))
        count0, queue0, ttft0 = before.classes.get(name, (0, 0.0, 0.0))
        fresh = count - count0
        means[f"queue_{name}_s"] = (queue - queue0) / fresh if fresh > 0 else None
        means[f"ttft_{name}_s"] = (ttft - ttft0) / fresh if fresh > 0 else None
    return means


def snapshot_of(ts: float, metrics: dict[str, Any]) -> Snapshot:
    scheduler = metrics.get("scheduler", {})
    cache = metrics.get("prefix_cache", {})
    spec = metrics.get("spec_decode", {})
    return Snapshot(
        ts,
        int(scheduler.get("tokens_generated", 0)),
        int(scheduler.get("prompt_tokens_total", 0)),
        int(cache.get("hit_tokens", 0)),
        int(spec.get("drafted", 0)),
        int(spec.get("accepted", 0)),
        _classes(metrics),
    )


def _rate(now: int, before: int, seconds: float) -> float | None:
    if now < before or seconds <= 0:
        return None
    return (now - before) / seconds


def _ratio(part_now: int, part_before: int, whole_now: int, whole_before: int) -> float | None:
    whole = whole_now - whole_before
    part = part_now - part_before
    if whole <= 0 or part < 0:
        return None
    return part / whole


def sample_of(
    ts: float, metrics: dict[str, Any] | None, serving: bool, previous: Snapshot | None
) -> tuple[Sample, Snapshot | None]:
    """The sample for this instant and the snapshot to compare the next one with."""
    if metrics is None:
        return Sample(ts, int(serving)), None
    now = snapshot_of(ts, metrics)
    scheduler = metrics.get("scheduler", {})
    cache = metrics.get("prefix_cache", {})
    rates: dict[str, float | None] = {}
    if previous is not None:
        seconds = now.ts - previous.ts
        rates = {
            "gen_tps": _rate(now.tokens_generated, previous.tokens_generated, seconds),
            "prompt_tps": _rate(now.prompt_tokens, previous.prompt_tokens, seconds),
            "prefix_hit_rate": _ratio(
                now.hit_tokens, previous.hit_tokens, now.prompt_tokens, previous.prompt_tokens
            ),
            "spec_acceptance": _ratio(
                now.accepted, previous.accepted, now.drafted, previous.drafted
            ),
            **_class_means(now, previous),
        }
    sample = Sample(
        ts,
        int(serving),
        ttft_hit_s=cache.get("ttft_avg_hit_s"),
        ttft_miss_s=cache.get("ttft_avg_miss_s"),
        kv_in_use=scheduler.get("kv_blocks_in_use"),
        kv_total=scheduler.get("kv_blocks_total"),
        running=scheduler.get("running"),
        waiting=scheduler.get("waiting"),
        **rates,
    )
    return sample, now


class Sampler:
    def __init__(
        self,
        history: HistoryStore,
        engine: Callable[[], EngineApi],
        interval_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.history = history
        self.engine = engine  # asked on every tick: the engine's address changes with a switch
        self.interval_s = interval_s
        self.clock = clock
        self._previous: Snapshot | None = None

    async def tick(self) -> Sample:
        engine = self.engine()
        health = await engine.health()
        metrics = await engine.metrics() if health.is_serving else None
        sample, self._previous = sample_of(self.clock(), metrics, health.is_serving, self._previous)
        await asyncio.to_thread(self.history.add, sample)
        return sample

    async def run(self, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        last_error = ""
        while True:
            try:
                await self.tick()
                last_error = ""
            except Exception as err:  # a sampling hiccup must never stop the history
                message = getattr(err, "message", None) or f"{type(err).__name__}: {err}"
                if message != last_error:  # once per cause, not every few seconds
                    log.warning("cannot sample the engine: %s", message)
                    last_error = message
            await sleep(self.interval_s)
