"""The overview's "Priorities and agent sessions" panel, shaped from the `priorities` and
`sessions` keys of the engine's `/v1/metrics` (docs/metrics.md): requests waiting and running
by priority with their mean queue time, TTFT and inter-token latency, and the most recently
seen agent sessions with the tokens they hold per tier, when they were last seen and their hit
rate. Whatever the engine sends (an older engine has neither key), the panel gets rows and a
note, never an error."""

from __future__ import annotations

from typing import Any


def _seconds(value: object) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _ago(value: object) -> str:
    if not isinstance(value, int | float):
        return "-"
    if value < 60:
        return f"{value:.0f} s ago"
    return f"{value / 60:.0f} min ago" if value < 3600 else f"{value / 3600:.1f} h ago"


def traffic_view(metrics: dict[str, Any] | None) -> dict[str, Any]:
    """`priorities` and `sessions` as rows of text, and `sessions_note`."""
    metrics = metrics or {}
    priorities = []
    for label, entry in (metrics.get("priorities") or {}).items():
        if not isinstance(entry, dict):
            continue
        priorities.append(
            {
                "priority": label,
                "waiting": entry.get("waiting", 0),
                "running": entry.get("running", 0),
                "requests": entry.get("requests", 0),
                "queue": _seconds(entry.get("queue_avg_s")),
                "ttft": _seconds(entry.get("ttft_avg_s")),
                "itl": _seconds(entry.get("itl_avg_s")),
            }
        )
    sessions = []
    for row in metrics.get("sessions") or []:
        if not isinstance(row, dict):
            continue
        tokens = row.get("tokens") or {}
        rate = row.get("hit_rate")
        seen = _ago(row.get("idle_s")) + (" (expired)" if row.get("expired") else "")
        sessions.append(
            {
                "id": str(row.get("id", "?")),
                "seen": seen,
                "held": f"{tokens.get('device', 0)} / {tokens.get('host', 0)}",
                "requests": row.get("requests", 0),
                "hit_rate": f"{rate:.0%}" if isinstance(rate, int | float) else "-",
            }
        )
    if not metrics:
        note = "the engine is not serving"
    elif "sessions" not in metrics:
        note = "this engine does not report agent sessions"
    elif not sessions:
        note = (
            "no agent session yet (prompt_cache_key, metadata.user_id or an x-session-id header "
            "name one)"
        )
    else:
        note = f"the {len(sessions)} most recently seen agent sessions"
    return {"priorities": priorities, "sessions": sessions, "sessions_note": note}
