"""Request priority: which work runs first when several clients share the engine.

A request's `SamplingParams.priority` (lower runs first, as vLLM orders it; 0 by default) ranks
it in every decision the scheduler makes: the order of admission, of the prefill budget
(`step_policy.StepPolicy.order`: by rank, then short prompts before long, then arrival), of the
running rows (the best first), and so who is preempted when blocks run out (the worst rank, the
newest of it; its computed blocks stay in the prefix cache, and move down its host tier, so it
comes back as a prefix hit). A waiting request that outranks a running one takes its place when
it would not fit otherwise (no free concurrency slot, or too few free blocks for its first
chunk).

Aging keeps lower priorities moving: a request that has not had tokens to compute for
`priority_aging_s` seconds ranks one better, and one more for each further such interval,
until it runs; decode rows progress every step, so only a request kept waiting or a prompt left
out of the budget ages. Over a stream of better-ranked work, a request `d` priority levels down
gets its turn within `d * priority_aging_s` seconds.
"""

from __future__ import annotations

from collections.abc import Iterable

from dgpp.engine.scheduling.request import Request


def rank_of(request: Request, now: float, aging_s: float) -> int:
    """The request's priority, less one per `aging_s` seconds since it last progressed."""
    priority = request.params.priority
    if aging_s <= 0 or request.progressed_at is None:
        return priority
    return priority - int(max(0.0, now - request.progressed_at) // aging_s)


def rerank(requests: Iterable[Request], now: float, aging_s: float) -> None:
    for request in requests:
        request.rank = rank_of(request, now, aging_s)


def priority_label(priority: int) -> str:
    """The metrics' label of a priority class (its value)."""
    return str(priority)


def queues_by_priority(
    running: Iterable[Request], waiting: Iterable[Request]
) -> dict[str, dict[str, int]]:
    """How many requests of each priority wait and run now (`EngineStats`)."""
    table: dict[str, dict[str, int]] = {}
    for state, requests in (("running", running), ("waiting", waiting)):
        for request in list(requests):
            counts = table.setdefault(priority_label(request.params.priority), {})
            counts[state] = counts.get(state, 0) + 1
    return {
        label: {"waiting": c.get("waiting", 0), "running": c.get("running", 0)}
        for label, c in table.items()
    }
