"""What a fault drill reports: what its clients saw, how long until the server served again, the
server's end state, and its pass checks; the checks every drill shares; the table.

The shared bar (vLLM/SGLang users' expectations): no 5xx other than a 503 with Retry-After and
an overload/unavailable code; no request that hangs; no stream that ends without `[DONE]`
(a stream cut by a fault must say so in an error event); nothing left allocated afterwards.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from load_clients import Outcome, RequestRecord

# The 503 codes that mean "retry later": the queue is full, the server drains before a restart,
# the world lost a rank, or the model is (still) loading.
UNAVAILABLE_CODES = frozenset(
    {"overloaded", "draining", "engine_failure", "world_reforming", "starting"}
)


@dataclass(frozen=True)
class DrillSettings:
    """What every drill takes from the command line."""

    model: str = "default"  # what the drills' servers serve (a name or a checkpoint path)
    clients: int = 3  # looping streamed clients while a fault is injected
    max_tokens: int = 24  # per request of those clients
    request_timeout_s: float = 120.0  # a request still open after this has hung
    serve_again_within_s: float = 90.0  # the bound on the time to serve again


@dataclass
class DrillResult:
    name: str
    fault: str  # what was done, in words
    records: list[RequestRecord] = field(default_factory=list)
    serve_again_s: float | None = None  # from the fault to the first successful request
    end: dict[str, Any] = field(default_factory=dict)  # faults_server.end_state
    checks: dict[str, bool] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)  # the drill's own measurements

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def outcomes(self) -> dict[str, int]:
        return dict(sorted(Counter(label(record) for record in self.records).items()))

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fault": self.fault,
            "passed": self.passed,
            "outcomes": self.outcomes(),
            "serve_again_s": _round(self.serve_again_s),
            "end": self.end,
            "checks": self.checks,
            "figures": self.figures,
        }


def label(record: RequestRecord) -> str:
    """What one client saw, in a few words."""
    outcome = record.outcome
    if outcome is Outcome.SUCCEEDED:
        return "200 [DONE]"
    if outcome in (Outcome.STREAM_ERROR, Outcome.STARTED_THEN_OVERLOADED):
        return f"200 then error event {record.detail}"
    if outcome is Outcome.ABORTED:
        return "closed by the client mid-stream"
    if outcome is Outcome.DISCONNECTED:
        return "closed by the client before the answer"
    if outcome is Outcome.LOST:
        return f"lost: {record.detail}"
    retry = " + Retry-After" if record.retry_after else ""
    return f"{record.status} {record.detail}{retry}"


def shared_checks(
    result: DrillResult,
    *,
    stream_errors: frozenset[str] = frozenset(),
    transport_errors: bool = False,
    serve_again_within_s: float | None = None,
) -> dict[str, bool]:
    """The bar every drill meets; `stream_errors`: the error-event codes a stream cut by this
    fault may end with; `transport_errors`: whether broken connections are expected (rank 0
    itself went away)."""
    records = result.records
    checks = {
        "only_precise_503": all(_is_precise_refusal(r) for r in records if (r.status or 0) >= 500),
        "no_hang_or_silent_end": all(
            _is_transport(r) for r in records if r.outcome is Outcome.LOST
        ),
        "stream_errors_expected": all(
            r.detail in stream_errors
            for r in records
            if r.outcome in (Outcome.STREAM_ERROR, Outcome.STARTED_THEN_OVERLOADED)
        ),
        "nothing_allocated": bool(result.end.get("idle")),
    }
    if not transport_errors:
        checks["no_broken_connection"] = not any(_is_transport(r) for r in records)
    if serve_again_within_s is not None:
        checks["serves_again"] = (
            result.serve_again_s is not None and result.serve_again_s <= serve_again_within_s
        )
    return checks


def _is_precise_refusal(record: RequestRecord) -> bool:
    return record.status == 503 and bool(record.retry_after) and record.detail in UNAVAILABLE_CODES


def _is_transport(record: RequestRecord) -> bool:
    return record.outcome is Outcome.LOST and record.detail.startswith("transport:")


def itl_figures(records: list[RequestRecord]) -> dict[str, float | int | None]:
    """Inter-token latency of `records` (seconds): count, p50, p95, max."""
    gaps = sorted(gap for record in records for gap in record.itl_s)
    if not gaps:
        return {"n": 0, "p50": None, "p95": None, "max": None}

    def pick(share: float) -> float:
        return round(gaps[min(len(gaps) - 1, int(share * len(gaps)))], 3)

    return {"n": len(gaps), "p50": pick(0.5), "p95": pick(0.95), "max": round(gaps[-1], 3)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def render(results: list[DrillResult]) -> str:
    """One block per drill: the fault, what clients saw, time to serve again, the end state,
    the checks; a PASS/FAIL line at the end."""
    lines = []
    header = f"{'drill':<20} {'result':<6} {'serves again':>12}  end state"
    lines += [header, "-" * len(header)]
    for result in results:
        again = "-" if result.serve_again_s is None else f"{result.serve_again_s:.2f} s"
        end = result.end
        state = (
            f"running {end.get('running')}, waiting {end.get('waiting')}, "
            f"KV {end.get('kv_blocks_in_use')}/{end.get('kv_blocks_total')} in use"
        )
        verdict = "PASS" if result.passed else "FAIL"
        lines.append(f"{result.name:<20} {verdict:<6} {again:>12}  {state}")
    for result in results:
        lines += ["", f"{result.name}: {result.fault}"]
        lines += [f"  {count:4d} x {what}" for what, count in result.outcomes().items()]
        lines += [f"  {key}: {value}" for key, value in result.figures.items()]
        failed = [name for name, ok in result.checks.items() if not ok]
        lines.append("  checks: " + ("all pass" if not failed else "FAIL " + ", ".join(failed)))
    passed = all(result.passed for result in results)
    lines += ["", f"{'PASS' if passed else 'FAIL'}: {len(results)} drills"]
    return "\n".join(lines)
