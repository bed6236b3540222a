"""bench/load_snapshots.py: per-interval rows and the soak checks, on synthetic snapshots."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from load_clients import Outcome, RequestRecord
from load_report import RunFacts, render, summarise
from load_snapshots import Snapshot, render_table, server_state, soak, take_snapshots

MIB = 2**20


def _body(
    minute: int, rss_mib: float, in_use: int = 10, total: int = 100, restart: bool = False
) -> dict[str, Any]:
    """A `/v1/metrics` body after `minute` minutes of steady traffic (counters grow linearly;
    `restart` puts them back near zero, as a restarted server's would be)."""
    n = 1 if restart else minute
    return {
        "scheduler": {
            "running": 2,
            "waiting": 1,
            "prefilling": 0,
            "kv_blocks_total": total,
            "kv_blocks_in_use": in_use,
            "tokens_generated": 600 * n,
            "prompt_tokens_total": 1000 * n,
            "prompt_tokens_computed": 250 * n,
            "decode_steps": 300 * n,
        },
        "service": {"requests_total": 12 * n, "succeeded": 10 * n, "shed": 2 * n},
        "prefix_cache": {"queries": 5 * n, "hits": 4 * n, "hit_tokens": 750 * n},
        "memory": {"host_rss_bytes": int(rss_mib * MIB), "device_allocated_bytes": None},
    }


def _series(rss_mib: list[float], **changes: Any) -> list[Snapshot]:
    """One snapshot a minute; minute m has 10 m successes, 3 m refusals, 1 m lost."""
    snaps = []
    for m, rss in enumerate(rss_mib, start=1):
        body = _body(m, rss, **(changes if m == len(rss_mib) else {}))
        outcomes = {"succeeded": 10 * m, "refused": 3 * m, "disconnected": m, "lost": m}
        snaps.append(Snapshot(60.0 * m, int(rss * MIB), server_state(body), outcomes, 300 * m))
    return snaps


def _soak(
    snaps: list[Snapshot], after: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, bool]]:
    end = after if after is not None else _body(len(snaps) + 1, 100, in_use=0)
    return soak(snaps, 60.0, 20.0, _body(0, 100), end, 60.0 * len(snaps) + 5)


def test_rows_are_intervals_of_cumulative_readings() -> None:
    section, checks = _soak(_series([100, 101, 102, 101, 100, 101]))
    assert checks == {"rss_no_drift": True, "kv_within_pool": True, "counters_monotonic": True}
    assert section["taken"] == 6 and len(section["rows"]) == 6
    row = section["rows"][2]
    assert row["t_s"] == 180.0 and row["rss_bytes"] == 102 * MIB
    assert (row["kv_blocks_in_use"], row["kv_blocks_total"], row["kv_blocks_free"]) == (10, 100, 90)
    assert (row["running"], row["waiting"]) == (2, 1)
    interval = row["interval"]
    assert interval["s"] == 60.0
    # Per interval, not cumulative: 10 ok, 3 refused, 1 disconnected (aborted), 1 lost (failed).
    assert interval["client"] == {"ok": 10, "refused": 3, "aborted": 1, "failed": 1}
    assert row["client_so_far"]["succeeded"] == 30
    assert interval["client_tok_per_s"] == 5.0  # 300 tokens in 60 s
    assert interval["generated_tok_per_s"] == 10.0  # 600 generated in 60 s
    assert interval["prefix_token_hit_rate"] == 0.75
    assert interval["server"]["succeeded"] == 10 and interval["server"]["shed"] == 2
    assert row["counters"]["service.succeeded"] == 30
    # The first interval is measured from the clients' start (the `before` body at t = 0).
    assert section["rows"][0]["interval"]["client"]["ok"] == 10
    table = "\n".join(render_table(section))
    assert "RSS MiB" in table and "10/100" in table and "75%" in table


def test_drift_compares_the_last_third_with_the_first_after_warmup() -> None:
    # Means of the thirds: 100 and 105 -> x1.05 passes; 100 and 105.5 fails.
    assert _soak(_series([100, 100, 103, 103, 105, 105]))[1]["rss_no_drift"]
    section, checks = _soak(_series([100, 100, 103, 103, 105, 106]))
    assert not checks["rss_no_drift"]
    assert section["rss_drift"]["ratio"] > 1.05
    assert section["rss_drift"]["first_bytes"] == 100 * MIB
    # A snapshot inside warm-up is not the baseline (a cold start's low RSS would hide growth).
    warm = _series([100, 100, 100, 100])
    early = Snapshot(10.0, 50 * MIB, warm[0].metrics, {}, 0)
    assert _soak([early, *warm])[0]["rss_drift"]["first_bytes"] == 100 * MIB
    # Growth in the middle that comes back is no drift; fewer than 3 readings cannot pass.
    assert _soak(_series([100, 120, 120, 100]))[1]["rss_no_drift"]
    assert not _soak(_series([100, 100]))[1]["rss_no_drift"]


def test_kv_beyond_the_pool_fails() -> None:
    section, checks = _soak(_series([100, 100, 100, 100], in_use=101))
    assert not checks["kv_within_pool"] and section["kv_overflows"] == ["at 240 s: 101 of 100"]
    assert _soak(_series([100, 100, 100, 100], in_use=100))[1]["kv_within_pool"]
    busy_end = _body(9, 100, in_use=200)
    assert not _soak(_series([100, 100, 100]), after=busy_end)[1]["kv_within_pool"]


def test_a_counter_going_down_is_a_restart() -> None:
    section, checks = _soak(_series([100, 100, 100, 100], restart=True))
    assert not checks["counters_monotonic"]
    assert "service.succeeded at 240 s: 30 -> 10" in section["counter_decreases"]
    # After the clients: a restart between the last snapshot and the end counts too.
    _, checks = _soak(_series([100, 100, 100]), after=_body(1, 100, in_use=0))
    assert not checks["counters_monotonic"]
    # Nothing to compare is no evidence either way: no snapshots fail.
    assert not _soak([])[1]["counters_monotonic"]


def test_report_adds_soak_checks_only_with_snapshots() -> None:
    records = [RequestRecord("short_whole", 0.0, Outcome.SUCCEEDED)]
    rss = [(20.0, 100 * MIB), (300.0, 100 * MIB)]
    plain = RunFacts(1, 300.0, 20.0, _body(0, 100), _body(6, 100, in_use=0), 1.0, rss)
    assert "rss_no_drift" not in summarise(records, plain)["checks"]
    facts = dataclasses.replace(
        plain, snapshots=_series([100, 100, 100, 110]), snapshot_every_s=60.0
    )
    summary = summarise(records, facts)
    assert summary["checks"]["counters_monotonic"] and summary["checks"]["kv_within_pool"]
    assert not summary["checks"]["rss_no_drift"] and not summary["passed"]
    text = render(summary)
    assert "FAIL  rss_no_drift" in text and "PASS  counters_monotonic" in text
    assert "snapshots every 60 s (4 taken)" in text


def test_snapshots_keep_to_their_grid_and_skip_missed_readings() -> None:
    calls = 0

    async def read() -> tuple[dict[str, Any], int | None]:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.3)  # a busy server answers the 0.2 s reading at 0.5 s
        if calls == 2:
            raise httpx.ReadTimeout("busy")
        return _body(calls, 100), 100 * MIB

    async def go() -> list[Snapshot]:
        snaps: list[Snapshot] = []
        records = [RequestRecord("short_whole", 0.0, Outcome.SUCCEEDED, completion_tokens=7)]
        task = asyncio.create_task(take_snapshots(read, time.monotonic(), 0.2, records, snaps))
        await asyncio.sleep(0.95)
        task.cancel()
        return snaps

    snaps = asyncio.run(go())
    # Slots at 0.2 (answered late), 0.4 (passed while waiting: not read), 0.6 (failed: no
    # snapshot) and 0.8 s: the grid is kept, however late or missing a reading is.
    assert calls == 3 and len(snaps) == 2
    assert 0.5 <= snaps[0].t_s < 0.6 and 0.8 <= snaps[1].t_s < 0.95
    assert snaps[0].client_outcomes == {"succeeded": 1} and snaps[0].client_tokens == 7
    assert snaps[0].metrics["memory"]["host_rss_bytes"] == 100 * MIB
