"""The report of bench/load.py: figures from the client records and the server's `/v1/metrics`,
the pass criteria, and their plain-text table; with snapshots, the soak table and checks of
bench/load_snapshots.py."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from load_clients import Outcome, RequestRecord
from load_snapshots import Snapshot, render_table, soak

RSS_GROWTH_LIMIT = 1.05  # RSS at the end may exceed RSS after warm-up by at most 5 %


@dataclass(frozen=True)
class RunFacts:
    """What bench/load.py observed besides the client records."""

    clients: int
    duration_s: float  # the client phase, warm-up included
    warmup_s: float
    metrics_before: dict[str, Any]  # /v1/metrics when the clients start
    metrics_after: dict[str, Any]  # /v1/metrics once the server settled after the clients
    settle_s: float  # how long the server took to get back to idle (or the cap, if it did not)
    rss_samples: list[tuple[float, int]]  # (seconds since the clients started, bytes)
    snapshots: list[Snapshot] = field(default_factory=list)
    snapshot_every_s: float = 0.0  # 0: snapshots were off (no soak section nor soak checks)


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """Nearest-rank p50/p95/p99 (None when there is nothing to rank)."""
    ordered = sorted(values)

    def rank(q: float) -> float | None:
        if not ordered:
            return None
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"n": len(ordered), "p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99)}


def _delta(before: dict[str, Any], after: dict[str, Any], section: str, key: str) -> int:
    return int((after.get(section) or {}).get(key) or 0) - int(
        (before.get(section) or {}).get(key) or 0
    )


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def rss_at_warmup(samples: list[tuple[float, int]], warmup_s: float) -> int | None:
    """The first sample taken at or after the end of warm-up."""
    return next((rss for t, rss in samples if t >= warmup_s), None)


def summarise(records: list[RequestRecord], facts: RunFacts) -> dict[str, Any]:
    """Every figure of the run and the pass checks, as one JSON-ready dict."""
    outcomes = Counter(r.outcome.value for r in records)
    refused = [r for r in records if r.outcome is Outcome.REFUSED]
    streamed = [r for r in records if r.ttft_s is not None]
    before, after = facts.metrics_before, facts.metrics_after
    queries = _delta(before, after, "prefix_cache", "queries")
    hits = _delta(before, after, "prefix_cache", "hits")
    hit_tokens = _delta(before, after, "prefix_cache", "hit_tokens")
    prompt_tokens = _delta(before, after, "scheduler", "prompt_tokens_total")
    tokens_out = sum(r.completion_tokens for r in records)
    scheduler = after.get("scheduler") or {}
    warm_rss = rss_at_warmup(facts.rss_samples, facts.warmup_s)
    end_rss = facts.rss_samples[-1][1] if facts.rss_samples else None
    server_errors = outcomes[Outcome.SERVER_ERROR.value] + outcomes[Outcome.STREAM_ERROR.value]
    checks = {
        "no_5xx": server_errors == 0,
        "no_started_then_overloaded": outcomes[Outcome.STARTED_THEN_OVERLOADED.value] == 0,
        "no_lost": outcomes[Outcome.LOST.value] == 0,
        "idle_at_end": bool(scheduler)
        and scheduler.get("running") == 0
        and scheduler.get("waiting") == 0
        and scheduler.get("kv_blocks_in_use") == 0,
        "rss_bounded": warm_rss is not None
        and end_rss is not None
        and end_rss <= warm_rss * RSS_GROWTH_LIMIT,
    }
    snapshots = None
    if facts.snapshot_every_s > 0:
        end_s = facts.duration_s + facts.settle_s
        snapshots, soak_checks = soak(
            facts.snapshots, facts.snapshot_every_s, facts.warmup_s, before, after, end_s
        )
        checks |= soak_checks
    return {
        "clients": facts.clients,
        "duration_s": round(facts.duration_s, 1),
        "warmup_s": facts.warmup_s,
        "requests": len(records),
        "outcomes": {o.value: outcomes[o.value] for o in Outcome},
        "refused_with_retry_after": sum(1 for r in refused if r.retry_after is not None),
        "refused_without_retry_after": sum(1 for r in refused if r.retry_after is None),
        "details": _details(records),
        "by_kind": {
            kind: dict(Counter(r.outcome.value for r in records if r.kind == kind))
            for kind in sorted({r.kind for r in records})
        },
        "ttft_s": percentiles([r.ttft_s for r in streamed if r.ttft_s is not None]),
        "itl_s": percentiles([gap for r in streamed for gap in r.itl_s]),
        "whole_latency_s": percentiles(
            [
                r.end_s - r.start_s
                for r in records
                if r.outcome is Outcome.SUCCEEDED and r.kind.endswith("whole")
            ]
        ),
        "output_tokens": tokens_out,
        "output_tok_per_s": tokens_out / facts.duration_s if facts.duration_s else None,
        "prefix_cache": {
            "queries": queries,
            "hits": hits,
            "request_hit_rate": _ratio(hits, queries),
            "hit_tokens": hit_tokens,
            "prompt_tokens": prompt_tokens,
            "token_hit_rate": _ratio(hit_tokens, prompt_tokens),
        },
        "server_counters": {
            key: _delta(before, after, "service", key)
            for key in ("requests_total", "succeeded", "failed", "cancelled", "shed", "rejected")
        },
        "rss": {
            "warmup_bytes": warm_rss,
            "end_bytes": end_rss,
            "max_bytes": max((rss for _, rss in facts.rss_samples), default=None),
            "end_over_warmup": _ratio(end_rss or 0, warm_rss or 0),
            "samples": [[round(t, 1), rss] for t, rss in facts.rss_samples],
        },
        "final": {
            key: scheduler.get(key)
            for key in ("running", "waiting", "kv_blocks_in_use", "kv_blocks_total")
        }
        | {"settle_s": round(facts.settle_s, 1)},
        "snapshots": snapshots,
        "checks": checks,
        "passed": all(checks.values()),
    }


def _details(records: list[RequestRecord]) -> dict[str, int]:
    """Counts of (outcome, detail) for everything that is neither a success nor intentional."""
    quiet = (Outcome.SUCCEEDED, Outcome.ABORTED, Outcome.DISCONNECTED)
    found = Counter(f"{r.outcome.value}: {r.detail}" for r in records if r.outcome not in quiet)
    return dict(found.most_common())


def _seconds(stats: dict[str, Any]) -> str:
    cells = [
        "-" if stats[q] is None else f"{stats[q] * 1000:.0f} ms" for q in ("p50", "p95", "p99")
    ]
    return f"p50 {cells[0]}, p95 {cells[1]}, p99 {cells[2]} (n={stats['n']})"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def render(summary: dict[str, Any]) -> str:
    """The plain-text table: outcomes, latencies, cache, memory, then one PASS/FAIL per check."""
    lines = [
        f"{summary['clients']} clients, {summary['duration_s']} s, "
        f"{summary['requests']} requests (warm-up: the first {summary['warmup_s']:.0f} s)",
        "",
        f"{'outcome':<26}{'requests':>9}",
    ]
    lines += [f"{name:<26}{count:>9}" for name, count in summary["outcomes"].items()]
    lines += [
        f"{'  refused with Retry-After':<26}{summary['refused_with_retry_after']:>9}",
        f"{'  refused without it':<26}{summary['refused_without_retry_after']:>9}",
        "",
    ]
    lines += [f"  {count:>5}  {what}" for what, count in summary["details"].items()]
    cache = summary["prefix_cache"]
    rss = summary["rss"]
    rate = cache["token_hit_rate"]
    request_rate = cache["request_hit_rate"]
    growth = rss["end_over_warmup"]
    shown = rss["samples"][:: max(1, len(rss["samples"]) // 12)]  # at most ~12 points
    lines += [
        f"TTFT (streamed)       {_seconds(summary['ttft_s'])}",
        f"inter-token latency   {_seconds(summary['itl_s'])}",
        f"whole-answer latency  {_seconds(summary['whole_latency_s'])}",
        f"output tokens         {summary['output_tokens']} "
        f"({summary['output_tok_per_s'] or 0:.1f} tok/s)",
        f"prefix cache          {cache['hits']}/{cache['queries']} requests hit"
        + ("" if request_rate is None else f" ({request_rate:.0%})")
        + f", {cache['hit_tokens']}/{cache['prompt_tokens']} prompt tokens"
        + ("" if rate is None else f" ({rate:.0%})"),
        "server counters       "
        + ", ".join(f"{k} {v}" for k, v in summary["server_counters"].items()),
        f"RSS                   after warm-up {_mib(rss['warmup_bytes'])}, "
        f"end {_mib(rss['end_bytes'])}, max {_mib(rss['max_bytes'])}"
        + ("" if growth is None else f" (end/warm-up {growth:.3f})"),
        "RSS over time         " + " ".join(f"{t:.0f}s:{_mib(b)}" for t, b in shown),
        "at the end            " + ", ".join(f"{k} {v}" for k, v in summary["final"].items()),
        "",
    ]
    if summary.get("snapshots"):
        lines += [*render_table(summary["snapshots"]), ""]
    lines += [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in summary["checks"].items()]
    lines.append("PASSED" if summary["passed"] else "FAILED")
    return "\n".join(lines)
