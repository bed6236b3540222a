"""Fault drills: inject one fault at a time into `dgpp serve --model default` on loopback while
clients stream, and report what the clients saw, how long until it served again, and whether
anything was left allocated.

    .venv/bin/python bench/faults.py [--drills queue_full,kv_full,...] [--json FILE]
                                     [--clients 3] [--max-tokens 24] [--log-dir DIR]

Drills, in the order they run (servers are shared: one world-1 server with little room for the
first five, one `--world 2` server with short deadlines for the next three, the console's own
engine for the last):

    queue_full            a burst of 8 streams on room for 3 running + 2 queued
    kv_full               3 ~420-token prompts growing by 96 tokens on a 1,024-token KV pool,
                          and one ~1,100-token prompt that can never fit
    disconnect            3 streams closed mid-way by their clients, a whole request after 1 s
    slow_reader           a ~200 KB stream read at 2 KB/s until the server is idle, then
                          closed, beside two normal streams
    restart_rank0         SIGKILL of the `dgpp serve` process under load, started again at once
    kill_worker           SIGKILL of worker rank 1 mid-stream (world 2)
    stop_worker           SIGSTOP of worker rank 1 mid-stream past the world's deadlines, then
                          SIGCONT
    restart_rank0_world2  restart_rank0 on the world of 2: the killed rank 0's worker must go
                          with it (within 3 s), the new one starts its own
    console_switch        a deployment switch (KV pool 2,048 -> 1,024 tokens) from the web
                          console under load: `dgpp webui` with the local backend, logged in,
                          POST /switch

Every drill checks the shared bar (bench/faults_report.py: no 5xx but a 503 with Retry-After
and an overload/unavailable code, no hang, no stream that ends without `[DONE]`, nothing
allocated at the end) and its own. The table goes to stdout; `--json FILE` writes every figure.
Exit 0 only when every drill passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

from faults_admission import ADMISSION_ARGS, ADMISSION_DRILLS
from faults_console import console_switch
from faults_report import DrillResult, DrillSettings, render
from faults_server import Serve
from faults_world import WORLD_ARGS, WORLD_DRILLS, WORLD_ENV, restart_rank0
from load import free_port

Drill = Callable[[Serve, DrillSettings], Awaitable[DrillResult]]
ADMISSION = [*ADMISSION_DRILLS, "restart_rank0"]  # the restart last: it replaces the process
ALL = [*ADMISSION, *WORLD_DRILLS, "console_switch"]


async def _run_on(
    serve: Serve, drills: dict[str, Drill], settings: DrillSettings, start_timeout_s: float
) -> list[DrillResult]:
    """Start `serve`, run `drills` on it one after the other, stop it. A server that does not
    start fails every drill of the group."""
    serve.launch()
    try:
        try:
            await serve.wait_healthy(start_timeout_s)
        except RuntimeError as err:
            return [_failed(name, f"the server did not start: {err}"[-2000:]) for name in drills]
        return [await _guarded(name, drill(serve, settings)) for name, drill in drills.items()]
    finally:
        serve.stop()


def _failed(name: str, error: str) -> DrillResult:
    result = DrillResult(name, "the drill itself failed")
    result.checks = {"drill_ran": False}
    result.figures = {"error": error}
    return result


async def _guarded(name: str, drill: Awaitable[DrillResult]) -> DrillResult:
    """The drill's result, or a failed one that says what broke it."""
    started = time.monotonic()
    try:
        result = await drill
    except Exception as err:  # a drill that breaks is a failed drill, the others still run
        result = _failed(name, "".join(traceback.format_exception_only(err)).strip()[-2000:])
    result.figures["drill_s"] = round(time.monotonic() - started, 1)
    return result


async def run(args: argparse.Namespace, settings: DrillSettings, logs: Path) -> list[DrillResult]:
    chosen = args.drills
    results: list[DrillResult] = []
    model = ["--model", settings.model]
    admission: dict[str, Drill] = {**ADMISSION_DRILLS, "restart_rank0": restart_rank0}
    picked = {name: drill for name, drill in admission.items() if name in chosen}
    if picked:
        serve = Serve([*model, *ADMISSION_ARGS, *args.server_arg], logs / "serve-admission.log")
        results += await _run_on(serve, picked, settings, args.start_timeout)
    picked = {name: drill for name, drill in WORLD_DRILLS.items() if name in chosen}
    if picked:
        serve = Serve(
            [*model, *WORLD_ARGS, "--rendezvous-port", str(free_port()), *args.server_arg],
            logs / "serve-world.log",
            dict(WORLD_ENV),
        )
        results += await _run_on(serve, picked, settings, args.start_timeout)
    if "console_switch" in chosen:
        results.append(
            await _guarded("console_switch", console_switch(logs, settings, args.start_timeout))
        )
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--drills",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=ALL,
        help=f"comma-separated, from {','.join(ALL)} (default: all)",
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--serve-again-within", type=float, default=90.0)
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--json", type=Path, help="write every drill's figures here")
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `dgpp serve` argument (repeat)"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.drills) - set(ALL))
    if unknown:
        parser.error(f"unknown drills: {', '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = DrillSettings(
        model=args.model,
        clients=args.clients,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        serve_again_within_s=args.serve_again_within,
    )
    with tempfile.TemporaryDirectory(prefix="dgpp-faults-") as scratch:
        logs = args.log_dir or Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run(args, settings, logs))
    print(render(results))
    if args.json:
        report = {
            "passed": all(r.passed for r in results),
            "drills": [r.as_json() for r in results],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if results and all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
