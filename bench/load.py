"""Load: N looping clients against `dgpp serve` for T minutes, bounded, on loopback.

    .venv/bin/python bench/load.py [--minutes 5 | --seconds 60] [--clients 32] [--json FILE]
                                   [--max-concurrency 8] [--queue-limit 8] [--url URL]
                                   [--snapshot-every SECONDS]
    .venv/bin/python bench/load.py --minutes 60 --json build/soak.json   # the soak

Starts `dgpp serve --model default` (the embedded SmolLM2-135M) with a small running batch and
queue (or targets `--url`), then runs `--clients` clients, each looping over a mix (one deck the
clients share) of streamed and whole Chat Completions: short prompts, ~3K-token prompts that share
two long prefixes (prefix cache hits), requests with a function tool (tool_choice auto), streams
the client cancels after a few events, and whole requests whose client closes the connection before
the answer. Every `--burst-every` seconds a burst of `--burst-size` simultaneous streams overflows
the queue. Before the clients start, one request per long prefix caches it (not counted in the
figures).

Every request gets one outcome (bench/load_clients.py). The report (bench/load_report.py; plain
text, and JSON with `--json`) gives requests by outcome, client-side TTFT and inter-token latency
percentiles from the SSE streams, output tok/s, 503s with and without Retry-After, the prefix hit
rate (the server's counters, delta over the run), the server's RSS every 5 s, and the scheduler
once the clients stopped. Warm-up is the first `--warmup-seconds` (20; a third of shorter runs).

Every `--snapshot-every` seconds (60 for runs of 10 minutes or more, else off; 0 = off) a
snapshot (bench/load_snapshots.py) reads `/v1/metrics` (memory, scheduler and KV gauges, the
request, token and prefix-cache counters) and the clients' tallies; the report gains one row
per snapshot (RSS, KV in use, running, waiting, requests by outcome, tok/s and prefix hit rate in
the interval) and three soak checks.

Exit 0 only when every check passes: no 5xx (nor an error event other than `overloaded` inside a
200 stream); no 200 stream that later reports `overloaded`; nothing lost (every request succeeded,
was refused with 503 before its answer started, or was given up by its client); running = waiting
= 0 and no KV block in use at the end; RSS at the end <= RSS after warm-up x 1.05. With
snapshots, also: the last third of the snapshots after warm-up has a mean RSS <= the first
third's x 1.05; KV blocks in use never above the pool; no server counter ever goes down.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import functools
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from load_clients import DOCUMENTS, KindDeck, RequestRecord, burst_loop, client_loop
from load_report import RunFacts, render, summarise
from load_snapshots import Snapshot, take_snapshots

RSS_EVERY_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the server's child process: the kernel sends it SIGTERM when this bench dies, even by
    SIGKILL (a test's timeout), so no server outlives its run."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen[bytes]:
    """`dgpp serve` on loopback, healthy (its log in `log`), like bench/agent_replay.py's."""
    command = [
        str(Path(sys.executable).with_name("dgpp")),
        "serve",
        "--model",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-concurrency",
        str(args.max_concurrency),
        "--queue-limit",
        str(args.queue_limit),
        "--kv-capacity",
        str(args.kv_capacity),
        "--max-model-len",
        str(args.max_model_len),
        "--log-level",
        "warning",
        *args.server_arg,
    ]
    return launch(command, f"http://127.0.0.1:{port}/health", log, args.start_timeout)


def launch(command: list[str], ready_url: str, log: Path, timeout_s: float) -> subprocess.Popen:
    """`command` started (its output in `log`, killed with this process) and returned once
    `ready_url` answers 200; killed, with its log's tail in the error, if it never does."""
    with log.open("wb") as sink:
        server = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(ready_url, timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    server.kill()
    server.wait()
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"{Path(command[0]).name} did not become ready:\n{tail}")


def stop_server(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


async def metrics(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/v1/metrics", timeout=30)
    response.raise_for_status()
    return response.json()


async def reading(client: httpx.AsyncClient, pid: int | None) -> tuple[dict[str, Any], int | None]:
    """`/v1/metrics` and the server's RSS: its memory.host_rss_bytes, else psutil on its pid."""
    body = await metrics(client)
    rss = (body.get("memory") or {}).get("host_rss_bytes")
    if rss is None and pid is not None:
        rss = psutil.Process(pid).memory_info().rss
    return body, rss


async def rss_now(client: httpx.AsyncClient, pid: int | None) -> int | None:
    return (await reading(client, pid))[1]


async def sample_rss(
    client: httpx.AsyncClient, pid: int | None, t0: float, samples: list[tuple[float, int]]
) -> None:
    """Append (seconds since t0, RSS) every RSS_EVERY_S until cancelled."""
    while True:
        try:
            rss = await rss_now(client, pid)
        except httpx.HTTPError:
            rss = None  # a busy server may miss one sample; the series goes on
        if rss is not None:
            samples.append((time.monotonic() - t0, rss))
        await asyncio.sleep(RSS_EVERY_S)


async def prime(client: httpx.AsyncClient, model: str) -> None:
    """One request per shared prefix, one at a time, before the clients start: the prefixes are
    then cached, as an agent fleet's system prompts are, so long requests prefill only their
    tails. Without this, the first requests of every prefix all prefill the whole prompt at once
    (none of them is cached before it finishes), which on CPU starves everything else."""
    for document in DOCUMENTS:
        body = {"model": model, "messages": [{"role": "system", "content": document}]}
        response = await client.post(
            "/v1/chat/completions", json=body | {"max_tokens": 1}, timeout=600
        )
        response.raise_for_status()


def is_idle(snapshot: dict[str, Any]) -> bool:
    scheduler = snapshot.get("scheduler") or {}
    return (
        scheduler.get("running") == 0
        and scheduler.get("waiting") == 0
        and scheduler.get("kv_blocks_in_use") == 0
    )


def phases(args: argparse.Namespace) -> tuple[float, float]:
    """The client phase's length and its warm-up, in seconds."""
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    warmup = args.warmup_seconds if args.warmup_seconds is not None else min(20.0, duration / 3)
    return duration, warmup


async def run(args: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    duration, warmup = phases(args)
    records: list[RequestRecord] = []
    samples: list[tuple[float, int]] = []
    snapshots: list[Snapshot] = []
    async with httpx.AsyncClient(base_url=url) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await prime(client, model)
        before = await metrics(client)
        t0 = time.monotonic()
        deadline = t0 + duration
        watchers = [asyncio.create_task(sample_rss(client, pid, t0, samples))]
        if args.snapshot_every > 0:
            read = functools.partial(reading, client, pid)
            watch = take_snapshots(read, t0, args.snapshot_every, records, snapshots)
            watchers.append(asyncio.create_task(watch))
        deck = KindDeck(args.seed)
        loops = [
            client_loop(url, model, args.seed + i, deadline, args.request_timeout, records, deck)
            for i in range(args.clients)
        ]
        if args.burst_size > 0:
            loops.append(
                burst_loop(
                    url,
                    model,
                    args.seed + 10_000,
                    deadline,
                    args.burst_size,
                    args.burst_every,
                    args.request_timeout,
                    records,
                )
            )
        await asyncio.gather(*loops)
        for watcher in watchers:
            watcher.cancel()
        clients_done = time.monotonic()
        # Aborted and disconnected requests are reaped by the engine's next steps: give it time.
        after = await metrics(client)
        while not is_idle(after) and time.monotonic() - clients_done < args.settle_timeout:
            await asyncio.sleep(0.5)
            after = await metrics(client)
        settle = time.monotonic() - clients_done
        rss = await rss_now(client, pid)
        if rss is not None:
            samples.append((time.monotonic() - t0, rss))
    facts = RunFacts(args.clients, clients_done - t0, warmup, before, after, settle, samples)
    facts = dataclasses.replace(facts, snapshots=snapshots, snapshot_every_s=args.snapshot_every)
    return summarise(records, facts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server instead of starting one")
    parser.add_argument("--model", default="default")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, help="run length in seconds (overrides minutes)")
    parser.add_argument("--warmup-seconds", type=float, help="20, or a third of shorter runs")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--queue-limit", type=int, default=8)
    parser.add_argument("--kv-capacity", type=int, default=32768, help="holds ~10 long prompts")
    parser.add_argument("--max-model-len", type=int, default=4096, help="room for ~3K prompts")
    parser.add_argument("--burst-size", type=int, default=24)
    parser.add_argument("--burst-every", type=float, default=15.0)
    parser.add_argument("--request-timeout", type=float, default=180.0)
    parser.add_argument("--settle-timeout", type=float, default=30.0)
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--snapshot-every",
        type=float,
        help="seconds between /v1/metrics snapshots: 60 for runs >= 10 min, else off; 0 = off",
    )
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--server-log", type=Path, help="keep the started server's log here")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `dgpp serve` argument (repeat)"
    )
    args = parser.parse_args(argv)
    duration, warmup = phases(args)
    if args.snapshot_every is None:
        args.snapshot_every = 60.0 if duration >= 600 else 0.0
    if args.snapshot_every > 0 and duration - warmup < 3 * args.snapshot_every:
        parser.error("--snapshot-every: the drift check needs 3 snapshots after warm-up")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    with tempfile.TemporaryDirectory(prefix="dgpp-load-") as scratch:
        try:
            if args.url:
                url = args.url.rstrip("/")
            else:
                port = free_port()
                log = args.server_log or Path(scratch) / "server.log"
                server = start_server(args, port, log)
                url = f"http://127.0.0.1:{port}"
            summary = asyncio.run(run(args, url, server.pid if server else None))
        finally:
            if server is not None:
                stop_server(server)
    summary["server"] = {
        "url": args.url,
        "model": args.model,
        "max_concurrency": args.max_concurrency,
        "queue_limit": args.queue_limit,
        "kv_capacity": args.kv_capacity,
        "max_model_len": args.max_model_len,
        "burst_size": args.burst_size,
        "burst_every_s": args.burst_every,
    }
    print(render(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
