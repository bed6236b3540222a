"""Side models under `dgpp serve` (issue 67): each a `dgpp serve` process of its own, single-rank,
on a Unix socket in a folder only this user reaches, behind rank 0's front
(`dgpp.engine.server.core.side_proxy`).

- A request for an unloaded side model starts it and waits for it up to `http.side_load_wait_s`;
  past that the request gets 503 with Retry-After while the load goes on.
- A side model idle `idle_unload_s` is stopped (`load: always` ones never).
- Where `side_memory_gib` bounds the side models' memory, a load that would not fit stops the least
  recently used idle side model first; with none idle it is refused (503). The main model is
  never touched.
- One that exits on its own (a crash) is seen within a second: an `always` one starts again, an
  on-demand one on its next request; the main model's requests never notice.
- A load that fails answers that request (and those within `RETRY_FAILED_S`) with 502 and the
  reason from the model's log; every other model keeps serving.
Every load, unload and crash is logged, counted, and listed in /v1/models and /v1/metrics.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from dgpp.appliance.common.paths import deployment_log_dir
from dgpp.appliance.deployments.deployment import Deployment
from dgpp.appliance.deployments.side_models import SideModel, side_model_for
from dgpp.appliance.runtime.side_entry import SideEntry, side_deployment
from dgpp.engine.errors import ConfigError
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.core.errors import RETRY_AFTER_SECONDS, APIError

log = logging.getLogger("dgpp.side")

RETRY_FAILED_S = 5.0  # a failed load is not retried sooner (each try is a process start)
STOP_GRACE_S = 20.0  # a side server told to stop is killed past this
PR_SET_PDEATHSIG = 1


class SideModels:
    """The side models of this node (every one, under `dgpp serve`); a `SideRouter`."""

    def __init__(
        self,
        sides: list[SideModel],
        runtime_dir: Path,
        log_dir: Path,
        log_level: str = "info",
        load_wait_s: float = 120.0,
        memory_bytes: int | None = None,
        common: dict[str, Any] | None = None,
    ) -> None:
        """`runtime_dir`: a private folder for the sockets and the side deployments;
        `log_dir`: where each side model's output goes (`side-<name>.log`); `memory_bytes`:
        what all side models may take together (None: no bound); `common`: deployment sections
        every side server shares (paths, resident cache)."""
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
        runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        runtime_dir.chmod(0o700)
        self.sides = sides
        models_dir = (common or {}).get("paths", {}).get("models_dir")
        self.entries = {
            side.name: SideEntry(side, runtime_dir / f"{side.name}.sock", models_dir)
            for side in sides
        }
        self.runtime_dir, self.log_dir, self.log_level = runtime_dir, log_dir, log_level
        self.load_wait_s = load_wait_s
        self.memory_bytes = memory_bytes
        self.common = common or {}
        self._lock = threading.Lock()  # held briefly, never while waiting on a process
        self._stopping = threading.Event()
        # Servers told to stop and not yet exited: (process, bytes it holds, kill deadline)
        self._exiting: list[tuple[subprocess.Popen[bytes], int, float]] = []
        self._thread: threading.Thread | None = None
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl
        # What starts a side model's server (its deployment file and log level follow)
        self.serve_command = [sys.executable, "-m", "dgpp.appliance.cli", "serve"]

    # -- SideRouter -------------------------------------------------------------------------

    def side_for(self, requested: str) -> str | None:
        found = side_model_for(self.sides, requested)
        return found.name if found is not None else None

    @asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[httpx.AsyncBaseTransport]:
        entry = self.entries[name]
        await self._ready(entry)
        with self._lock:
            entry.in_flight += 1
        try:
            yield httpx.AsyncHTTPTransport(uds=str(entry.socket))
        finally:
            with self._lock:
                entry.in_flight -= 1
                entry.last_used = time.monotonic()

    def peek(self, name: str) -> httpx.AsyncBaseTransport | None:
        """A transport to side model `name` if it is loaded now; it is not loaded for this, nor
        its idle time reset (the console's metrics polls must not keep it loaded)."""
        with self._lock:
            entry = self.entries.get(name)
            if entry is None or entry.state != "loaded":
                return None
            return httpx.AsyncHTTPTransport(uds=str(entry.socket))

    def listing(self) -> list[dict[str, Any]]:
        with self._lock:
            return [entry.card() for entry in self.entries.values()]

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the `always` side models and the supervising thread."""
        with self._lock:
            for entry in self.entries.values():
                entry.memory()  # planned once, here, not under a request
                if entry.side.load == "always":
                    self._request(entry)
        self._thread = threading.Thread(target=self._supervise, name="dgpp-side", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            for entry in self.entries.values():
                self._unload(entry, "the server stops")
            stopping, self._exiting = self._exiting, []
        _reap([process for process, _, _ in stopping], timeout_s)

    def unload(self, name: str) -> bool:
        """Stop side model `name` now and wait till its server exited (the console's button;
        call it off the event loop); whether it was running."""
        with self._lock:
            entry = self.entries[name]
            process = entry.process
            self._unload(entry, "asked to")
        if process is not None:
            _reap([process], STOP_GRACE_S)
        return process is not None

    async def load(self, name: str) -> None:
        """Load side model `name` and wait for it (the console's button)."""
        await self._ready(self.entries[name])

    async def _ready(self, entry: SideEntry) -> None:
        started = time.monotonic()
        with self._lock:
            if entry.state == "failed" and started - entry.failed_at < RETRY_FAILED_S:
                raise _load_failed(entry)
            if entry.state in ("unloaded", "failed"):
                self._request(entry)
        while True:
            with self._lock:
                state = entry.state
            if state == "loaded":
                return
            if state in ("failed", "unloaded"):  # it failed (or was stopped) while we waited
                raise _load_failed(entry)
            if time.monotonic() - started > self.load_wait_s:
                raise APIError(
                    503,
                    f"side model {entry.side.name!r} is still loading "
                    f"({time.monotonic() - entry.load_started:.0f} s so far); retry shortly",
                    type_="server_error",
                    code="model_loading",
                    headers={"Retry-After": RETRY_AFTER_SECONDS},
                )
            await asyncio.sleep(0.05)

    def _request(self, entry: SideEntry) -> None:
        """Under `_lock`, never waiting: make room (idle side models are told to stop), then
        mark the side model loading; the supervising thread starts its server once the memory
        of those stopping is free."""
        self._make_room(entry)
        entry.state, entry.load_started, entry.error = "loading", time.monotonic(), None
        entry.spawn_pending = True

    def _spawn(self, entry: SideEntry) -> None:
        """Under `_lock`: start the side model's server."""
        path = self.runtime_dir / f"{entry.side.name}.json"
        path.write_text(json.dumps(side_deployment(entry.side, entry.socket, self.common)))
        entry.socket.unlink(missing_ok=True)
        command = [*self.serve_command, "--deployment", str(path), "--log-level", self.log_level]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        entry.log_path = self.log_dir / f"side-{entry.side.name}.log"
        with entry.log_path.open("ab") as output:
            entry.process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, preexec_fn=self._die_with_head
            )
        entry.spawn_pending = False
        log.info("loading side model %s (pid %d)", entry.side.name, entry.process.pid)

    def _held(self, entry: SideEntry, stopping: bool) -> int:
        """Under `_lock`: the bytes the other side models hold or are about to (and, with
        `stopping`, those still exiting)."""
        held = sum(
            other.memory()
            for other in self.entries.values()
            if other is not entry and (other.process is not None or other.spawn_pending)
        )
        return held + (sum(size for _, size, _ in self._exiting) if stopping else 0)

    def _make_room(self, entry: SideEntry) -> None:
        if self.memory_bytes is None:
            return
        need = entry.memory()
        while self._held(entry, stopping=False) + need > self.memory_bytes:
            idle = [e for e in self.entries.values() if e.is_idle and e.side.load != "always"]
            if not idle:
                busy = ", ".join(e.side.name for e in self.entries.values() if e.process)
                raise APIError(
                    503,
                    f"side model {entry.side.name!r} does not fit beside {busy} "
                    "(side_memory_gib), and none of them is idle; retry shortly",
                    type_="server_error",
                    code="no_room",
                    headers={"Retry-After": RETRY_AFTER_SECONDS},
                )
            self._unload(min(idle, key=lambda e: e.last_used), f"making room for {entry.side.name}")

    def _unload(self, entry: SideEntry, why: str) -> None:
        """Under `_lock`, never waiting: tell its server to stop (the supervising thread reaps
        it, and kills it past `STOP_GRACE_S`); a load not started yet is called off."""
        process, pending = entry.process, entry.spawn_pending
        entry.process, entry.spawn_pending = None, False
        if process is None:
            if pending:
                entry.state = "unloaded"
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            self._exiting.append((process, entry.memory(), time.monotonic() + STOP_GRACE_S))
        entry.state = "unloaded"
        entry.unloads += 1
        log.info("unloaded side model %s: %s", entry.side.name, why)

    def _supervise(self) -> None:
        while not self._stopping.wait(0.1):
            with self._lock:
                self._reap_exiting()
                for entry in self.entries.values():
                    self._check(entry)
                loading = [e for e in self.entries.values() if e.state == "loading" and e.process]
            ready = [entry for entry in loading if entry.healthy()]  # HTTP, off the lock
            with self._lock:
                for entry in ready:
                    if entry.state == "loading" and entry.process is not None:
                        entry.state = "loaded"
                        entry.loads += 1
                        entry.load_seconds = time.monotonic() - entry.load_started
                        entry.last_used = time.monotonic()
                        log.info("side model %s loaded in %.1f s", entry.side.name,
                                 entry.load_seconds)  # fmt: skip

    def _reap_exiting(self) -> None:
        """Under `_lock`: forget the servers that exited; kill those past their grace."""
        now, kept = time.monotonic(), []
        for process, size, deadline in self._exiting:
            if process.poll() is not None:
                continue
            if now > deadline:
                log.warning("side server pid %d did not stop in time; killing it", process.pid)
                process.kill()
            kept.append((process, size, deadline))
        self._exiting = kept

    def _check(self, entry: SideEntry) -> None:
        """Under `_lock`: a pending load that now has room, a load that failed, a crash, an
        idle timeout."""
        if entry.spawn_pending:
            room = self.memory_bytes is None or (
                self._held(entry, stopping=True) + entry.memory() <= self.memory_bytes
            )
            if room:
                try:
                    self._spawn(entry)
                except OSError as err:  # no process: the load fails, nothing else does
                    entry.spawn_pending = False
                    entry.fail(f"its server could not be started: {err}")
            return
        process = entry.process
        if process is None:
            return
        if process.poll() is not None:
            entry.process = None
            if entry.state == "loading":
                entry.fail(f"its server exited with {process.returncode} while loading")
                log.warning("side model %s failed to load: %s", entry.side.name, entry.error)
                return
            entry.crashes += 1
            entry.state = "unloaded"
            log.warning("side model %s exited (%s); main model unaffected", entry.side.name,
                        process.returncode)  # fmt: skip
            if entry.side.load == "always" and not self._stopping.is_set():
                try:
                    self._request(entry)
                except APIError as err:  # no room: its next request tries again
                    entry.fail(err.message)
            return
        if entry.state == "loaded" and entry.side.load != "always":
            limit = entry.side.idle_unload_s
            if limit > 0 and entry.idle_for > limit:
                self._unload(entry, f"idle {limit:g} s")

    def _die_with_head(self) -> None:
        """In the side model's child: SIGTERM when the thread that started it goes away."""
        self._prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _load_failed(entry: SideEntry) -> APIError:
    return APIError(
        502,
        f"side model {entry.side.name!r} could not be loaded: {entry.error or 'it stopped'}",
        type_="server_error",
        code="model_load_failed",
    )


def head_side_models(
    deployment: Deployment, server: ServerConfig, ident: str | None, log_level: str, local: bool
) -> SideModels | None:
    """The side models rank 0 runs (None: the deployment has none). Under `dgpp serve`
    (`local`) all run on this machine; on a cluster, those of node 0 (the others' units are
    not built yet: refused, saying so)."""
    sides = deployment.side_models
    if not sides:
        return None
    remote = [side.name for side in sides if side.node != 0]
    if remote and not local:
        raise ConfigError(
            f"side models {', '.join(remote)} are placed on another node; this release runs "
            "side models on node 0 (rank 0's) only"
        )
    runtime = Path(tempfile.mkdtemp(prefix="dgpp-side-"))
    logs = deployment_log_dir(ident) if ident else runtime
    common = deployment.model_dump(include={"paths", "resident_cache"}, exclude_unset=True)
    memory = deployment.side_memory_gib
    return SideModels(
        sides,
        runtime,
        logs,
        log_level,
        server.side_load_wait_s,
        None if memory is None else int(memory * (1 << 30)),
        common,
    )


def _reap(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait for `processes` to exit (SIGTERM sent); kill what is left after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
