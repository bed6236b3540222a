"""What the overview shows of the switches: a marker on the charts for each one, and a banner
while the last switch that ended did not keep its deployment (rolled back, or failed).

Both read the switcher's jobs (`Switcher.history`) and nothing else of them than ident, title,
phase, reason, started_at and finished_at."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dgpp.webui.switch.switcher import SwitchJob

NOT_KEPT = frozenset({"rolled back", "failed"})  # phases that end a switch without its change


def switch_events(jobs: Iterable[SwitchJob], since: float) -> list[dict[str, Any]]:
    """One marker per switch that ended (or, still running, started) at or after `since`:
    `at` is when it ended (ready, rolled back, failed), else when it started."""
    events = []
    for job in jobs:
        at = job.finished_at if job.finished_at is not None else job.started_at
        if at >= since:
            phase = str(job.phase)
            events.append(
                {
                    "id": job.ident,
                    "at": at,
                    "phase": phase,
                    "title": job.title,
                    "reason": job.reason,
                }
            )
    return sorted(events, key=lambda event: event["at"])


def rollback_banner(jobs: Iterable[SwitchJob]) -> dict[str, Any] | None:
    """The banner's content when the latest switch that ended was not kept; None once a later
    one succeeded (a switch still running changes nothing until it ends)."""
    ended = [job for job in jobs if job.finished_at is not None]
    if not ended:
        return None
    last = max(ended, key=lambda job: job.finished_at or 0.0)
    phase = str(last.phase)
    if phase not in NOT_KEPT:
        return None
    return {
        "id": last.ident,
        "phase": phase,
        "title": last.title,
        "reason": last.reason or "no reason recorded",
        "at": last.finished_at,
    }
