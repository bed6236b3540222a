"""The overview's priorities and sessions panel from `/v1/metrics`: rows of text for what an
engine reports, a note for what it does not (an older engine, no session yet, not serving)."""

from __future__ import annotations

from dgpp.webui.monitor.traffic_view import traffic_view


def test_priorities_and_sessions_read_as_text() -> None:
    metrics = {
        "priorities": {
            "0": {"waiting": 1, "running": 2, "requests": 9, "queue_avg_s": 0.004,
                  "ttft_avg_s": 0.25, "itl_avg_s": 0.05},
            "10": {"waiting": 3, "running": 5, "requests": 40, "queue_avg_s": 4.2,
                   "ttft_avg_s": None, "itl_avg_s": "odd"},
        },
        "sessions": [
            {"id": "default/1a2b3c4d", "idle_s": 30.0, "expired": False,
             "tokens": {"device": 4096, "host": 1024}, "requests": 6, "hit_rate": 0.912},
            {"id": "ci/5e6f7a8b", "idle_s": 7200.0, "expired": True, "tokens": {"device": 0},
             "requests": 1, "hit_rate": None},
            "not a row",
        ],
    }  # fmt: skip
    view = traffic_view(metrics)
    assert view["priorities"] == [
        {"priority": "0", "waiting": 1, "running": 2, "requests": 9, "queue": "4 ms",
         "ttft": "250 ms", "itl": "50 ms"},
        {"priority": "10", "waiting": 3, "running": 5, "requests": 40, "queue": "4.20 s",
         "ttft": "-", "itl": "-"},
    ]  # fmt: skip
    assert view["sessions"] == [
        {"id": "default/1a2b3c4d", "seen": "30 s ago", "held": "4096 / 1024", "requests": 6,
         "hit_rate": "91%"},
        {"id": "ci/5e6f7a8b", "seen": "2.0 h ago (expired)", "held": "0 / 0", "requests": 1,
         "hit_rate": "-"},
    ]  # fmt: skip
    assert view["sessions_note"] == "the 2 most recently seen agent sessions"


def test_what_an_engine_does_not_report_is_a_note() -> None:
    assert traffic_view(None)["sessions_note"] == "the engine is not serving"
    older = traffic_view({"scheduler": {}})
    assert older["priorities"] == [] and older["sessions"] == []
    assert older["sessions_note"] == "this engine does not report agent sessions"
    assert traffic_view({"sessions": []})["sessions_note"].startswith("no agent session yet")
