"""Service-side metrics of one app: request outcomes, tokens and tool calls handed to clients,
and latency histograms. `create_app` keeps one `ServiceMetrics` on `app.state.dgpp_metrics`.

Each generation request (chat, completions, messages) gets one `RequestTracker`, kept in the
ASGI scope's state so the route, the stream and the error handlers all find the same one; its
first outcome is the one counted. Docs: docs/metrics.md.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.types import Scope

from dgpp.engine.scheduling.request import RequestOutput
from dgpp.engine.scheduling.stats import MAX_PRIORITY_CLASSES, PROMPT_CLASSES
from dgpp.engine.server.metrics.histogram import (
    E2E_BUCKETS_S,
    ITL_BUCKETS_S,
    TTFT_BUCKETS_S,
    Histogram,
)

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages"})
TRACKER_KEY = "dgpp_tracker"


class Outcome(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # 5xx other than overload: engine failure, internal error, still starting
    CANCELLED = "cancelled"  # the client went away before the answer was complete
    SHED = "shed"  # 503 overloaded: the queue was full
    REJECTED = "rejected"  # 4xx: the request itself was wrong


def outcome_of(status: int, code: str | None) -> Outcome:
    """The outcome of an API error, by its status and code."""
    if status == 503 and code == "overloaded":
        return Outcome.SHED
    if status >= 500:
        return Outcome.FAILED
    if status >= 400:
        return Outcome.REJECTED
    return Outcome.SUCCEEDED


@dataclass
class ServiceCounters:
    """Cumulative counts over API requests; `requests_total` is the sum of the five outcomes."""

    requests_total: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    shed: int = 0
    rejected: int = 0
    tokens_out: int = 0  # completion tokens of every finished choice
    tool_calls_out: int = 0  # tool calls parsed out of answers


@dataclass(frozen=True)
class Latencies:
    """A copy of the latency histograms, per finished choice (engine request)."""

    ttft_hit: Histogram
    ttft_miss: Histogram
    inter_token: Histogram
    e2e: Histogram
    queue: Histogram
    # By prompt class ("short" / "long", the scheduler's rule on the prefill a request needed).
    ttft_by_class: dict[str, Histogram]
    queue_by_class: dict[str, Histogram]
    # By request priority: {"ttft" | "queue" | "itl": {priority label: histogram}}
    by_priority: dict[str, dict[str, Histogram]] = field(
        default_factory=lambda: {"ttft": {}, "queue": {}, "itl": {}}
    )

    def copy(self) -> Latencies:
        return Latencies(
            self.ttft_hit.copy(),
            self.ttft_miss.copy(),
            self.inter_token.copy(),
            self.e2e.copy(),
            self.queue.copy(),
            {name: h.copy() for name, h in self.ttft_by_class.items()},
            {name: h.copy() for name, h in self.queue_by_class.items()},
            {
                kind: {label: h.copy() for label, h in table.items()}
                for kind, table in self.by_priority.items()
            },
        )

    def priority(self, kind: str, priority: int) -> Histogram:
        """The `kind` histogram of a priority (made on first use; "other" past the bound)."""
        table, label = self.by_priority[kind], str(priority)
        if label not in table and len(table) >= MAX_PRIORITY_CLASSES:
            label = "other"
        if label not in table:
            table[label] = Histogram(ITL_BUCKETS_S if kind == "itl" else TTFT_BUCKETS_S)
        return table[label]


class ServiceMetrics:
    """Counters and histograms, safe to update and read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = ServiceCounters()
        self._latencies = Latencies(
            ttft_hit=Histogram(TTFT_BUCKETS_S),
            ttft_miss=Histogram(TTFT_BUCKETS_S),
            inter_token=Histogram(ITL_BUCKETS_S),
            e2e=Histogram(E2E_BUCKETS_S),
            queue=Histogram(TTFT_BUCKETS_S),
            ttft_by_class={name: Histogram(TTFT_BUCKETS_S) for name in PROMPT_CLASSES},
            queue_by_class={name: Histogram(TTFT_BUCKETS_S) for name in PROMPT_CLASSES},
        )

    def counters(self) -> ServiceCounters:
        with self._lock:
            return replace(self._counters)

    def latencies(self) -> Latencies:
        with self._lock:
            return self._latencies.copy()

    def record_outcome(self, outcome: Outcome) -> None:
        with self._lock:
            counters = self._counters
            counters.requests_total += 1
            setattr(counters, outcome.value, getattr(counters, outcome.value) + 1)

    def record_tool_calls(self, count: int) -> None:
        with self._lock:
            self._counters.tool_calls_out += count

    def record_finished(self, output: RequestOutput) -> None:
        """Count one finished choice: its tokens, and its latencies when the engine timed it."""
        num_tokens = len(output.outputs[0].token_ids) if output.outputs else 0
        with self._lock:
            self._counters.tokens_out += num_tokens
            timings, lat = output.timings, self._latencies
            if timings is None:
                return
            prompt_class = output.prompt_class or ""
            if timings.first_scheduled is not None:
                queue = max(0.0, timings.first_scheduled - timings.arrival)
                lat.queue.observe(queue)
                lat.priority("queue", output.priority).observe(queue)
                if prompt_class in lat.queue_by_class:
                    lat.queue_by_class[prompt_class].observe(queue)
            if timings.first_token is not None:
                ttft = max(0.0, timings.first_token - timings.arrival)
                (lat.ttft_hit if output.num_cached_tokens > 0 else lat.ttft_miss).observe(ttft)
                lat.priority("ttft", output.priority).observe(ttft)
                if prompt_class in lat.ttft_by_class:
                    lat.ttft_by_class[prompt_class].observe(ttft)
            if timings.finished is not None:
                lat.e2e.observe(max(0.0, timings.finished - timings.arrival))
                if timings.first_token is not None and num_tokens > 1:
                    # The mean gap, once per gap: the count is the number of inter-token gaps.
                    decode = max(0.0, timings.finished - timings.first_token)
                    lat.inter_token.observe(decode / (num_tokens - 1), num_tokens - 1)
                    gap = decode / (num_tokens - 1)
                    lat.priority("itl", output.priority).observe(gap, num_tokens - 1)


class RequestTracker:
    """One API request's outcome (counted once: the first wins) and its finished choices."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics
        self.outcome: Outcome | None = None

    def finish(self, outcome: Outcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.metrics.record_outcome(outcome)

    def finished_choice(self, output: RequestOutput) -> None:
        self.metrics.record_finished(output)

    def tool_calls(self, count: int) -> None:
        if count:
            self.metrics.record_tool_calls(count)


def request_tracker(scope: Scope, any_path: bool = False) -> RequestTracker | None:
    """This HTTP request's tracker, created on first use; None when it has none and is off the
    generation routes (unless `any_path`), or in an app without `ServiceMetrics`."""
    state = scope.setdefault("state", {})
    tracker = state.get(TRACKER_KEY)
    if tracker is not None:
        return tracker
    path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
    if not any_path and path not in GENERATION_PATHS:
        return None
    app: Any = scope.get("app")
    metrics = getattr(getattr(app, "state", None), "dgpp_metrics", None)
    if not isinstance(metrics, ServiceMetrics):
        return None
    tracker = state[TRACKER_KEY] = RequestTracker(metrics)
    return tracker


def record_error(scope: Scope, status: int, code: str | None) -> None:
    """Count an error response of a generation route (the error handlers and guards call this)."""
    tracker = request_tracker(scope)
    if tracker is not None:
        tracker.finish(outcome_of(status, code))
