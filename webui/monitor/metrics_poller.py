"""Samples the engine every few seconds into the history: its JSON `/v1/metrics` and its
Prometheus `/metrics` (the latency histograms).

Everything per interval comes from the difference of two snapshots of the engine's cumulative
counters: token and request rates, hit and acceptance ratios, mean queue time and TTFT by
prompt class, and p50 / p95 of TTFT, inter-token and end-to-end latency (`latency_histogram`).
A counter that went down means the engine restarted, and that interval has no value; so has an
interval with nothing to divide by (no request, no draft). KV use and memory are the state at
the sampling instant. Fields and units: docs/metrics.md; the charts: docs/webui.md."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dgpp.webui.monitor.engine_client import EngineApi
from dgpp.webui.monitor.history import HistoryStore, Sample
from dgpp.webui.monitor.latency_histogram import LATENCY_FAMILIES, Buckets, read_histograms

log = logging.getLogger(__name__)

OUTCOMES = ("succeeded", "failed", "shed", "cancelled", "rejected")  # `service` counters
QUANTILES = (("p50", 0.5), ("p95", 0.95))


@dataclass(frozen=True)
class Snapshot:
    ts: float
    tokens_generated: int
    prompt_tokens: int
    hit_tokens: int
    host_hit_tokens: int  # of `hit_tokens`, loaded back from the host tier
    disk_hit_tokens: int  # of `host_hit_tokens`, read back from disk
    drafted: int
    accepted: int
    # Per prompt class: (requests, queue seconds summed, TTFT seconds summed).
    classes: dict[str, tuple[int, float, float]]
    outcomes: dict[str, int]  # API requests by outcome, cumulative
    latencies: dict[str, Buckets]  # by LATENCY_FAMILIES key; absent when /metrics had none
    # Images admitted, encoded, encoder seconds, encoder-cache hits (vision-language models).
    vision: tuple[int, int, float, int] = (0, 0, 0.0, 0)


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


def _latencies(exposition: str | None) -> dict[str, Buckets]:
    if exposition is None:
        return {}
    histograms = read_histograms(exposition, LATENCY_FAMILIES.values())
    return {key: histograms[name] for key, name in LATENCY_FAMILIES.items() if name in histograms}


def snapshot_of(ts: float, metrics: dict[str, Any], exposition: str | None = None) -> Snapshot:
    scheduler = metrics.get("scheduler", {})
    cache = metrics.get("prefix_cache", {})
    spec = metrics.get("spec_decode", {})
    service = metrics.get("service") or {}
    return Snapshot(
        ts,
        int(scheduler.get("tokens_generated", 0)),
        int(scheduler.get("prompt_tokens_total", 0)),
        int(cache.get("hit_tokens", 0)),
        int(cache.get("host_hit_tokens", 0)),
        int(cache.get("disk_hit_tokens", 0)),
        int(spec.get("drafted", 0)),
        int(spec.get("accepted", 0)),
        _classes(metrics),
        {name: int(service[name]) for name in OUTCOMES if name in service},
        _latencies(exposition),
        _vision(metrics),
    )


def _vision(metrics: dict[str, Any]) -> tuple[int, int, float, int]:
    vision = metrics.get("vision") or {}
    return (
        int(vision.get("images", 0)),
        int(vision.get("encoded", 0)),
        float(vision.get("encoder_seconds", 0.0)),
        int(vision.get("encoder_cache_hits", 0)),
    )


def _vision_rates(now: Snapshot, before: Snapshot, seconds: float) -> dict[str, float | None]:
    images, encoded, spent, hits = now.vision
    images0, encoded0, spent0, hits0 = before.vision
    fresh = encoded - encoded0
    return {
        "images_rps": _rate(images, images0, seconds),
        "encoder_ms": (spent - spent0) * 1000 / fresh if fresh > 0 else None,
        "image_cache_hit_rate": _ratio(hits, hits0, hits + encoded, hits0 + encoded0),
    }


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


def _tier_rates(now: Snapshot, before: Snapshot) -> dict[str, float | None]:
    """Hit tokens by tier over prompt tokens, between two snapshots: device (still in the
    pool), host (loaded back from host memory), disk (read back from disk)."""
    tiers = {
        "device": (
            now.hit_tokens - now.host_hit_tokens,
            before.hit_tokens - before.host_hit_tokens,
        ),
        "host": (
            now.host_hit_tokens - now.disk_hit_tokens,
            before.host_hit_tokens - before.disk_hit_tokens,
        ),
        "disk": (now.disk_hit_tokens, before.disk_hit_tokens),
    }
    return {
        f"prefix_{tier}_rate": _ratio(part, part0, now.prompt_tokens, before.prompt_tokens)
        for tier, (part, part0) in tiers.items()
    }


def _outcome_rates(now: Snapshot, before: Snapshot, seconds: float) -> dict[str, float | None]:
    return {
        f"{name}_rps": _rate(now.outcomes[name], before.outcomes[name], seconds)
        if name in now.outcomes and name in before.outcomes
        else None
        for name in OUTCOMES
    }


def _quantiles(now: Snapshot, before: Snapshot) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in LATENCY_FAMILIES:
        current, previous = now.latencies.get(key), before.latencies.get(key)
        interval = current.since(previous) if current and previous else None
        for label, q in QUANTILES:
            out[f"{key}_{label}_s"] = interval.quantile(q) if interval else None
    return out


def _kv(scheduler: dict[str, Any]) -> dict[str, float | int | None]:
    in_use, total = scheduler.get("kv_blocks_in_use"), scheduler.get("kv_blocks_total")
    block_size = scheduler.get("kv_block_size")
    return {
        "kv_in_use": in_use,
        "kv_total": total,
        "kv_used_pct": 100.0 * in_use / total if in_use is not None and total else None,
        "kv_tokens_total": scheduler.get("kv_tokens_total")
        or (total * block_size if total is not None and block_size else None),
    }


def _memory(metrics: dict[str, Any]) -> dict[str, int | None]:
    memory = metrics.get("memory") or {}
    names = ("host_rss_bytes", "device_allocated_bytes", "device_reserved_bytes")
    return {name: memory.get(name) for name in (*names, "device_total_bytes")}


def sample_of(
    ts: float,
    metrics: dict[str, Any] | None,
    serving: bool,
    previous: Snapshot | None,
    exposition: str | None = None,
) -> tuple[Sample, Snapshot | None]:
    """The sample for this instant and the snapshot to compare the next one with. `metrics` is
    the `/v1/metrics` body, `exposition` the `/metrics` text (None: not read)."""
    if metrics is None:
        return Sample(ts, int(serving)), None
    now = snapshot_of(ts, metrics, exposition)
    scheduler = metrics.get("scheduler", {})
    rates: dict[str, float | None] = {}
    if previous is not None:
        seconds = now.ts - previous.ts
        rates = {
            "gen_tps": _rate(now.tokens_generated, previous.tokens_generated, seconds),
            "prompt_tps": _rate(now.prompt_tokens, previous.prompt_tokens, seconds),
            "prefix_hit_rate": _ratio(
                now.hit_tokens, previous.hit_tokens, now.prompt_tokens, previous.prompt_tokens
            ),
            **_tier_rates(now, previous),
            "spec_acceptance": _ratio(
                now.accepted, previous.accepted, now.drafted, previous.drafted
            ),
            **_class_means(now, previous),
            **_outcome_rates(now, previous, seconds),
            **_quantiles(now, previous),
            **_vision_rates(now, previous, seconds),
        }
    state: dict[str, Any] = {
        "running": scheduler.get("running"),
        "waiting": scheduler.get("waiting"),
        **_kv(scheduler),
        **_memory(metrics),
    }
    return Sample(ts, int(serving), **state, **rates), now


class MetricsPoller:
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
        self._sides: dict[str, Snapshot] = {}  # each loaded side model's last snapshot

    async def tick(self) -> Sample:
        engine = self.engine()
        health = await engine.health()
        metrics = exposition = None
        if health.is_serving:
            metrics = await engine.metrics()
            exposition = await engine.prometheus() if metrics is not None else None
        now = self.clock()
        sample, self._previous = sample_of(
            now, metrics, health.is_serving, self._previous, exposition
        )
        await asyncio.to_thread(self.history.add, sample)
        await self._side_ticks(engine, now, (metrics or {}).get("side_models") or [])
        return sample

    async def _side_ticks(self, engine: EngineApi, now: float, cards: list[Any]) -> None:
        """A sample of each loaded side model, from its own metrics through rank 0 (asking
        never loads it); an unloaded one's next sample starts afresh."""
        loaded = [c["id"] for c in cards if isinstance(c, dict) and c.get("state") == "loaded"]
        for name in set(self._sides) - set(loaded):
            del self._sides[name]
        for name in loaded:
            metrics = await engine.metrics(name)
            if metrics is None:  # it stopped since the listing
                self._sides.pop(name, None)
                continue
            exposition = await engine.prometheus(name)
            sample, self._sides[name] = sample_of(
                now, metrics, True, self._sides.get(name), exposition
            )
            await asyncio.to_thread(self.history.add, sample, name)

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
