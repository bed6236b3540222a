"""The `dgpp serve` a fault drill runs against: one process on loopback, started (and started
again after a kill) with the same command line, dying with the bench (PR_SET_PDEATHSIG), its
worker ranks found through psutil, and its `/v1/metrics` read for the end state.

Always launch from the main thread: the kernel sends PR_SET_PDEATHSIG when the *thread* that
forked the child exits, so a server launched from a worker thread would die with that thread.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from heal import worker_pid
from load import _die_with_parent, free_port, is_idle, metrics, stop_server

MODEL = "m"  # every drill's server answers to this name
PROBE_EVERY_S = 0.25


@dataclass
class Serve:
    """`dgpp serve ARGS --port PORT`; `log` collects the output of every launch."""

    args: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "not launched"
        return self.process.pid

    def command(self) -> list[str]:
        dgpp = str(Path(sys.executable).with_name("dgpp"))
        head = [dgpp, "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        return [*head, "--served-model-name", MODEL, "--log-level", "warning", *self.args]

    def launch(self) -> None:
        """Start the process; returns at once (`wait_healthy` follows it)."""
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(
                self.command(),
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, "GOMP_SPINCOUNT": "0", **self.env},
                preexec_fn=_die_with_parent,
            )

    async def wait_healthy(self, timeout_s: float) -> float:
        """Until `/health` answers 200: the monotonic time it did."""
        return await wait_ok(f"{self.url}/health", self.process, timeout_s, self.tail)

    def kill(self) -> None:
        """SIGKILL the process (rank 0) and reap it."""
        assert self.process is not None, "not launched"
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            stop_server(self.process)

    def worker(self) -> int | None:
        """The live `dgpp rank` child of a `--world 2` server."""
        assert self.process is not None, "not launched"
        return worker_pid(self.process)

    def signal_worker(self, sig: int) -> int:
        victim = self.worker()
        assert victim is not None, "no worker rank"
        os.kill(victim, sig)
        return victim

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    async def metrics(self) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=self.url) as client:
            return await metrics(client)


async def wait_ok(
    url: str,
    process: subprocess.Popen[bytes] | None,
    timeout_s: float,
    tail: Callable[[], str],
) -> float:
    """Until GET `url` answers 200 (while `process` runs): the monotonic time it did."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{url}: the process exited:\n{tail()}")
            try:
                if (await client.get(url)).status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            await asyncio.sleep(PROBE_EVERY_S)
    raise RuntimeError(f"{url}: no 200 after {timeout_s:.0f} s:\n{tail()}")


async def serve_again(url: str, since: float, timeout_s: float) -> float | None:
    """Seconds from `since` (monotonic) to the first completion that succeeds; None if none
    did within `timeout_s`."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    deadline = since + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.post("/v1/completions", json=body)).status_code == 200:
                    return time.monotonic() - since
            except httpx.HTTPError:
                pass
            await asyncio.sleep(PROBE_EVERY_S)
    return None


async def end_state(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The scheduler of the server at `url` once idle (or after `timeout_s`), with how long it
    took to get there."""
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url) as client:
        snapshot = await metrics(client)
        while not is_idle(snapshot) and time.monotonic() - started < timeout_s:
            await asyncio.sleep(0.25)
            snapshot = await metrics(client)
    scheduler = snapshot["scheduler"]
    return {
        "idle": is_idle(snapshot),
        "settle_s": round(time.monotonic() - started, 2),
        "running": scheduler["running"],
        "waiting": scheduler["waiting"],
        "kv_blocks_in_use": scheduler["kv_blocks_in_use"],
        "kv_blocks_total": scheduler["kv_blocks_total"],
        "kv_block_size": scheduler["kv_block_size"],
        "service": snapshot["service"],
    }
