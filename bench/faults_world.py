"""Fault drills on the ranks: SIGKILL a worker rank mid-stream, SIGSTOP one past the world's
deadlines (then SIGCONT it), both on a `dgpp serve --world 2`; and SIGKILL rank 0 itself (the
`dgpp serve` process) under load and start it again with the same command line.

`serve_again_s` is measured from the fault (the signal) to the next successful completion.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx
import psutil
from faults_clients import under_load
from faults_report import DrillResult, DrillSettings, shared_checks
from faults_server import MODEL, Serve, end_state, serve_again
from load_clients import Outcome, RequestRecord

# Short world deadlines, so a stopped worker is given up within seconds (the defaults are
# minutes): a worker waits DEADLINE_S for rank 0's next command, rank 0 DEADLINE_S for one
# collective of a forward.
DEADLINE_S = 8
# Room for 2 running: of the drills' 3 streams and 1 whole request, some wait in the queue
# when the fault comes.
WORLD_ARGS = ["--world", "2", "--kv-capacity", "2048", "--max-model-len", "1024"]
WORLD_ARGS += ["--max-concurrency", "2"]
WORLD_ENV = {
    "DGPP_CONSUMER_DEADLINE_S": str(DEADLINE_S),
    "DGPP_BOUNDARY_TIMEOUT_MS": str(DEADLINE_S * 1000),
}
CUT = frozenset({"engine_failure"})  # the error event of a stream cut by a lost rank
AFTER_S = 2.0  # clients keep going this long once the server serves again
ORPHAN_S = 3.0  # a killed rank 0's worker must be gone this soon (a new rank 0 takes longer)


def _cut(records: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.outcome is Outcome.STREAM_ERROR and r.detail in CUT]


async def kill_worker(serve: Serve, settings: DrillSettings) -> DrillResult:
    result = DrillResult("kill_worker", "SIGKILL of worker rank 1 mid-stream (world 2)")
    total = (await serve.metrics())["scheduler"]["kv_blocks_total"]
    async with under_load(serve.url, settings, result.records):
        killed_at = time.monotonic()
        victim = serve.signal_worker(signal.SIGKILL)
        result.serve_again_s = await serve_again(
            serve.url, killed_at, settings.serve_again_within_s
        )
        await asyncio.sleep(AFTER_S)
    result.end = await end_state(serve.url)
    restarted = serve.worker()
    result.figures = {"cut_streams": len(_cut(result.records))}
    result.checks = shared_checks(
        result, stream_errors=CUT, serve_again_within_s=settings.serve_again_within_s
    )
    result.checks["cut_stream_ends_with_error_event"] = bool(_cut(result.records))
    result.checks["worker_restarted"] = restarted is not None and restarted != victim
    result.checks["kv_pool_unchanged"] = result.end["kv_blocks_total"] == total
    return result


async def _while_stopped(url: str) -> dict[str, Any]:
    """What a client gets from a world with a stopped worker once rank 0 gave it up."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        health = await client.get("/health")
        answer = await client.post("/v1/completions", json=body)
    code = answer.json().get("error", {}).get("code") if answer.status_code != 200 else None
    return {
        "health": f"{health.status_code} {health.json().get('state')}",
        "completion": f"{answer.status_code} {code}",
        "retry_after": answer.headers.get("retry-after"),
    }


async def stop_worker(serve: Serve, settings: DrillSettings) -> DrillResult:
    result = DrillResult(
        "stop_worker",
        f"SIGSTOP of worker rank 1 mid-stream for deadline ({DEADLINE_S} s) + 4 s, then SIGCONT "
        "(world 2)",
    )
    async with under_load(serve.url, settings, result.records):
        stopped_at = time.monotonic()
        victim = serve.signal_worker(signal.SIGSTOP)
        try:
            await asyncio.sleep(DEADLINE_S + 4)
            seen = await _while_stopped(serve.url)
        finally:
            os.kill(victim, signal.SIGCONT)
        continued_at = time.monotonic()
        result.serve_again_s = await serve_again(
            serve.url, stopped_at, settings.serve_again_within_s + DEADLINE_S
        )
        await asyncio.sleep(AFTER_S)
    result.end = await end_state(serve.url)
    cut = _cut(result.records)
    error_after = min((r.end_s - stopped_at for r in cut), default=None)
    result.figures = {
        "cut_streams": len(cut),
        "error_event_after_stop_s": None if error_after is None else round(error_after, 2),
        "while_stopped": seen,
        "serves_again_after_sigcont_s": None
        if result.serve_again_s is None
        else round(stopped_at + result.serve_again_s - continued_at, 2),
    }
    result.checks = shared_checks(
        result,
        stream_errors=CUT,
        serve_again_within_s=settings.serve_again_within_s + DEADLINE_S,
    )
    result.checks["cut_stream_ends_with_error_event"] = bool(cut)
    result.checks["error_within_deadline"] = (
        error_after is not None and error_after <= DEADLINE_S + 4
    )
    result.checks["unavailable_is_a_precise_503"] = (
        seen["completion"].startswith("503") and seen["retry_after"] is not None
    )
    result.checks["same_worker_rejoined"] = serve.worker() == victim
    return result


async def _gone_after(pid: int, since: float, timeout_s: float = 30.0) -> float | None:
    """Seconds from `since` until process `pid` has exited (or is a zombie); None if it still
    ran after `timeout_s`."""
    while time.monotonic() < since + timeout_s:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - since
        except psutil.NoSuchProcess:
            return time.monotonic() - since
        await asyncio.sleep(0.05)
    return None


async def restart_rank0(serve: Serve, settings: DrillSettings) -> DrillResult:
    """Leaves `serve` running again (the new process). In a world of 2 the old worker, orphaned,
    must go away (the new rank 0 holds another cluster secret and starts its own)."""
    orphan = serve.worker()
    result = DrillResult(
        "restart_rank0" if orphan is None else "restart_rank0_world2",
        "SIGKILL of rank 0 (the `dgpp serve` process) under load, started again at once "
        "with the same command line (warm: resident weight image)",
    )
    async with under_load(serve.url, settings, result.records):
        killed_at = time.monotonic()
        serve.kill()
        serve.launch()
        orphan_gone = asyncio.create_task(_gone_after(orphan, killed_at)) if orphan else None
        healthy_at = await serve.wait_healthy(settings.serve_again_within_s)
        result.serve_again_s = await serve_again(
            serve.url, killed_at, settings.serve_again_within_s
        )
        await asyncio.sleep(AFTER_S)
    result.end = await end_state(serve.url)
    broken = [r for r in result.records if r.detail.startswith("transport:")]
    result.figures = {
        "health_200_after_s": round(healthy_at - killed_at, 2),
        "broken_connections": len(broken),
        "cut_mid_stream": sum(1 for r in broken if r.ttft_s is not None),
    }
    result.checks = shared_checks(
        result, transport_errors=True, serve_again_within_s=settings.serve_again_within_s
    )
    if orphan_gone is not None:
        gone_s = await orphan_gone
        result.figures["old_worker_exited_after_s"] = None if gone_s is None else round(gone_s, 2)
        # Before the new rank 0 could refuse it: the old worker went with its rank 0.
        result.checks["old_worker_went_with_rank0"] = gone_s is not None and gone_s <= ORPHAN_S
    result.checks["only_connection_errors_or_503"] = all(
        r.outcome in (Outcome.SUCCEEDED, Outcome.LOST)
        or (r.status == 503 and r.retry_after is not None)
        for r in result.records
    )
    return result


WORLD_DRILLS = {
    "kill_worker": kill_worker,
    "stop_worker": stop_worker,
    "restart_rank0_world2": restart_rank0,
}
