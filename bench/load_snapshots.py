"""The soak snapshots of bench/load.py: the server's state from `/v1/metrics` and the clients'
tallies every `--snapshot-every` seconds, their per-interval table, and the soak checks.

A snapshot holds cumulative values only (server counters, client requests by outcome so far);
every per-interval figure is the difference between a snapshot and the one before it (the first
one's predecessor is `/v1/metrics` when the clients started). The soak checks:

- `rss_no_drift`: the mean RSS of the last third of the snapshots after warm-up <= the mean of
  the first third x 1.05 (needs at least 3 snapshots after warm-up);
- `kv_within_pool`: `kv_blocks_in_use` never above `kv_blocks_total` (nor below 0);
- `counters_monotonic`: no cumulative server counter ever goes down, from the clients' start to
  after they stopped (a counter going down is a server restart).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import httpx
from load_clients import Outcome, RequestRecord

RSS_DRIFT_LIMIT = 1.05  # last third's mean RSS may exceed the first third's by at most 5 %

# The cumulative counters of `/v1/metrics`, by section, none of which may ever go down: these,
# and every field of `service` (the server's `ServiceCounters`: requests by outcome, tokens out).
COUNTERS = {
    "scheduler": (
        "tokens_generated",
        "prompt_tokens_total",
        "prompt_tokens_computed",
        "decode_steps",
    ),
    "prefix_cache": ("queries", "hits", "misses", "hit_tokens", "evictions", "skipped_inserts"),
}
GAUGES = ("running", "waiting", "prefilling", "kv_blocks_in_use", "kv_blocks_total")
MEMORY = ("device_allocated_bytes", "device_reserved_bytes", "device_total_bytes")

# The table's request columns: client outcomes folded into four groups.
GROUPS = {
    Outcome.SUCCEEDED.value: "ok",
    Outcome.REFUSED.value: "refused",
    Outcome.ABORTED.value: "aborted",  # both ways a client gives up on purpose
    Outcome.DISCONNECTED.value: "aborted",
}


@dataclass(frozen=True)
class Snapshot:
    """One reading: cumulative figures only, so that intervals are differences."""

    t_s: float  # seconds since the clients started
    rss_bytes: int | None
    metrics: dict[str, Any]  # the `/v1/metrics` body (see `server_state` for what is read)
    client_outcomes: dict[str, int]  # requests finished so far, by `Outcome` value
    client_tokens: int  # completion tokens of those


def take(
    t_s: float, body: dict[str, Any], rss: int | None, records: list[RequestRecord]
) -> Snapshot:
    """A snapshot of `body` (a `/v1/metrics` answer) and of the records finished so far (a
    burst's records arrive together once its last request is done)."""
    outcomes = Counter(r.outcome.value for r in records)
    tokens = sum(r.completion_tokens for r in records)
    return Snapshot(t_s, rss, server_state(body), dict(outcomes), tokens)


async def take_snapshots(
    read: Callable[[], Awaitable[tuple[dict[str, Any], int | None]]],
    t0: float,
    every_s: float,
    records: list[RequestRecord],
    snapshots: list[Snapshot],
) -> None:
    """Append a snapshot of `read()` (a `/v1/metrics` body and the server's RSS) and `records`
    at t0 + every_s, t0 + 2 x every_s, ... (monotonic) until cancelled. The slots stay on that
    grid: a reading a busy server answers late or not at all (skipped, so that interval is
    longer) does not shift the ones after it."""
    slot = 1
    while True:
        await asyncio.sleep(max(0.0, t0 + slot * every_s - time.monotonic()))
        try:
            body, rss = await read()
        except httpx.HTTPError:
            body, rss = None, None
        now = time.monotonic() - t0
        if body is not None:
            snapshots.append(take(now, body, rss, records))
        slot = max(slot + 1, math.floor(now / every_s) + 1)


def server_state(body: dict[str, Any]) -> dict[str, Any]:
    """The parts of a `/v1/metrics` body a soak follows: counters, gauges, memory."""
    state = {
        section: {key: (body.get(section) or {}).get(key) for key in keys}
        for section, keys in COUNTERS.items()
    }
    state["service"] = dict(body.get("service") or {})
    scheduler = body.get("scheduler") or {}
    state["scheduler"] |= {key: scheduler.get(key) for key in GAUGES}
    memory = body.get("memory") or {}
    state["memory"] = {key: memory.get(key) for key in ("host_rss_bytes", *MEMORY)}
    return state


def counters(state: dict[str, Any]) -> dict[str, int]:
    """Every cumulative counter of a server state, as {"section.key": value}."""
    found = {f"service.{key}": int(value or 0) for key, value in state["service"].items()}
    for section, keys in COUNTERS.items():
        found |= {f"{section}.{key}": _value(state, section, key) for key in keys}
    return found


def _value(state: dict[str, Any], section: str, key: str) -> int:
    return int((state.get(section) or {}).get(key) or 0)


def _delta(before: dict[str, Any], after: dict[str, Any], section: str, key: str) -> int:
    return _value(after, section, key) - _value(before, section, key)


def _grouped(outcomes: dict[str, int]) -> dict[str, int]:
    groups = Counter({"ok": 0, "refused": 0, "aborted": 0, "failed": 0})
    for outcome, count in outcomes.items():
        groups[GROUPS.get(outcome, "failed")] += count
    return dict(groups)


def rows(snapshots: list[Snapshot], before: dict[str, Any]) -> list[dict[str, Any]]:
    """One JSON-ready row per snapshot: its state and what changed since the one before."""
    found = []
    previous = Snapshot(0.0, None, server_state(before), {}, 0)
    for snap in snapshots:
        span = snap.t_s - previous.t_s
        state, was = snap.metrics, previous.metrics
        prompt = _delta(was, state, "scheduler", "prompt_tokens_total")
        hit_tokens = _delta(was, state, "prefix_cache", "hit_tokens")
        outcomes = Counter(snap.client_outcomes)
        outcomes.subtract(previous.client_outcomes)
        scheduler = state["scheduler"]
        total, in_use = scheduler["kv_blocks_total"], scheduler["kv_blocks_in_use"]
        found.append(
            {
                "t_s": round(snap.t_s, 1),
                "rss_bytes": snap.rss_bytes,
                **{key: state["memory"][key] for key in MEMORY},
                **{key: scheduler[key] for key in GAUGES},
                "kv_blocks_free": None if None in (total, in_use) else total - in_use,
                "counters": counters(state),
                "client_so_far": dict(snap.client_outcomes),
                "interval": {
                    "s": round(span, 1),
                    "client": _grouped(dict(outcomes)),
                    "client_outcomes": {k: v for k, v in outcomes.items() if v},
                    "client_tok_per_s": _rate(snap.client_tokens - previous.client_tokens, span),
                    "generated_tok_per_s": _rate(
                        _delta(was, state, "scheduler", "tokens_generated"), span
                    ),
                    "server": {key: _delta(was, state, "service", key) for key in state["service"]},
                    "prompt_tokens": prompt,
                    "prefix_hit_tokens": hit_tokens,
                    "prefix_token_hit_rate": hit_tokens / prompt if prompt else None,
                },
            }
        )
        previous = snap
    return found


def _rate(count: int, span_s: float) -> float | None:
    return count / span_s if span_s > 0 else None


def drift(snapshots: list[Snapshot], warmup_s: float) -> dict[str, Any]:
    """Mean RSS of the first and last thirds of the snapshots taken after warm-up."""
    series = [s.rss_bytes for s in snapshots if s.t_s >= warmup_s and s.rss_bytes is not None]
    third = len(series) // 3
    if third == 0:
        return {"snapshots": len(series), "first_bytes": None, "last_bytes": None, "ratio": None}
    first, last = fmean(series[:third]), fmean(series[-third:])
    return {
        "snapshots": len(series),
        "first_bytes": round(first),
        "last_bytes": round(last),
        "ratio": last / first,
    }


def counter_decreases(states: list[tuple[float, dict[str, Any]]]) -> list[str]:
    """Every counter that went down between consecutive (time, server state) readings."""
    found = []
    for (_, was), (t_s, state) in itertools.pairwise(states):
        old, new = counters(was), counters(state)
        # A counter that vanished reads as 0, so a server without it counts as a restart.
        found += [
            f"{name} at {t_s:.0f} s: {value} -> {new.get(name, 0)}"
            for name, value in old.items()
            if new.get(name, 0) < value
        ]
    return found


def kv_overflows(states: list[tuple[float, dict[str, Any]]]) -> list[str]:
    """Every reading whose KV blocks in use are unknown, negative or above the pool."""
    found = []
    for t_s, state in states:
        scheduler = state.get("scheduler") or {}
        in_use, total = scheduler.get("kv_blocks_in_use"), scheduler.get("kv_blocks_total")
        if in_use is None or total is None or not 0 <= in_use <= total:
            found.append(f"at {t_s:.0f} s: {in_use} of {total}")
    return found


def soak(
    snapshots: list[Snapshot],
    every_s: float,
    warmup_s: float,
    metrics_before: dict[str, Any],
    metrics_after: dict[str, Any],
    end_s: float,
) -> tuple[dict[str, Any], dict[str, bool]]:
    """The JSON-ready `snapshots` section of the report, and the three soak checks."""
    states = [(0.0, server_state(metrics_before))]
    states += [(s.t_s, s.metrics) for s in snapshots]
    states.append((end_s, server_state(metrics_after)))
    rss = drift(snapshots, warmup_s)
    decreases = counter_decreases(states)
    overflows = kv_overflows(states[1:])  # the clients' start is before any load
    section = {
        "every_s": every_s,
        "taken": len(snapshots),
        "rss_drift": rss,
        "counter_decreases": decreases,
        "kv_overflows": overflows,
        "rows": rows(snapshots, metrics_before),
    }
    checks = {
        "rss_no_drift": rss["ratio"] is not None and rss["ratio"] <= RSS_DRIFT_LIMIT,
        "kv_within_pool": bool(snapshots) and not overflows,
        "counters_monotonic": bool(snapshots) and not decreases,
    }
    return section, checks


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(section: dict[str, Any]) -> list[str]:
    """The per-snapshot table, then the drift and any decrease or overflow found."""
    lines = [
        f"snapshots every {section['every_s']:.0f} s ({section['taken']} taken); "
        "requests and rates are per interval",
        f"{'min':>5} {'RSS MiB':>8} {'KV use/total':>13} {'run':>4} {'wait':>5} {'ok':>5} "
        f"{'refused':>8} {'aborted':>8} {'failed':>7} {'tok/s':>6} {'gen/s':>6} {'hit':>5}",
    ]
    for row in section["rows"]:
        interval, client = row["interval"], row["interval"]["client"]
        rss = None if row["rss_bytes"] is None else row["rss_bytes"] / 2**20
        kv = f"{row['kv_blocks_in_use']}/{row['kv_blocks_total']}"
        lines.append(
            f"{row['t_s'] / 60:>5.1f} {_cell(rss, '.0f'):>8} {kv:>13} {row['running']!s:>4} "
            f"{row['waiting']!s:>5} {client['ok']:>5} {client['refused']:>8} "
            f"{client['aborted']:>8} {client['failed']:>7} "
            f"{_cell(interval['client_tok_per_s'], '.1f'):>6} "
            f"{_cell(interval['generated_tok_per_s'], '.1f'):>6} "
            f"{_cell(interval['prefix_token_hit_rate'], '.0%'):>5}"
        )
    rss = section["rss_drift"]
    lines.append(
        f"RSS drift             {rss['snapshots']} snapshots after warm-up; "
        + (
            "too few for thirds (3 needed)"
            if rss["ratio"] is None
            else f"first third {rss['first_bytes'] / 2**20:.0f} MiB, "
            f"last third {rss['last_bytes'] / 2**20:.0f} MiB (x{rss['ratio']:.3f})"
        )
    )
    lines += [f"counter went down     {what}" for what in section["counter_decreases"]]
    lines += [f"KV beyond the pool    {what}" for what in section["kv_overflows"]]
    return lines
