"""The local process backend: a world's worker ranks as child processes of this machine,
restarted whenever one exits, the way systemd's `Restart=always` restarts `dgpp@rankN`, and
killed (then restarted) when one stops feeding its watchdog, as `WatchdogSec=` does."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

from dgpp.appliance.common.exit_codes import EXIT_CONFIG
from dgpp.appliance.runtime.cluster_secret_file import secret_env
from dgpp.appliance.runtime.local_watchdog import WATCHDOG_S, WatchdogInbox
from dgpp.engine.distributed.world_spec import WorldTimeouts

log = logging.getLogger(__name__)

_POLL_S = 0.2
_STALL_S = 1.0  # a supervisor loop this late means this process was not running either
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    started: float
    restarts: int = 0
    restart_at: float | None = None  # when an exited rank is due to start again


class LocalWorkers:
    """Starts ranks 1..world_size-1 as `dgpp rank` processes joining the head on loopback."""

    def __init__(
        self,
        world_size: int,
        port: int,
        timeouts: WorldTimeouts,
        log_level: str = "info",
        restart_delay_s: float = 0.5,
        secret: bytes | None = None,
        watchdog_s: float | None = WATCHDOG_S,
    ) -> None:
        """`secret`: the cluster secret, handed to each rank in its environment (never on its
        command line). `watchdog_s`: how long a rank may send no `WATCHDOG=1` before it is
        killed and restarted (None: never)."""
        self.world_size = world_size
        self.secret = secret
        self.port = port
        self.timeouts = timeouts
        self.log_level = log_level
        self.restart_delay_s = restart_delay_s
        self._ranks: dict[int, _Rank] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Resolved here, not in the forked child: a child of a threaded process must not load
        # libraries or take Python's import lock before it execs.
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl
        self._head_pid = os.getpid()
        self._watchdog = WatchdogInbox(watchdog_s) if watchdog_s else None
        self._grace_until = 0.0

    def command(self, rank: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "dgpp.appliance.cli",
            "rank",
            "--rank",
            str(rank),
            "--head",
            "127.0.0.1",
            "--rendezvous-port",
            str(self.port),
            "--timeouts",
            json.dumps(asdict(self.timeouts)),
            "--log-level",
            self.log_level,
        ]

    def start(self) -> None:
        with self._lock:
            for rank in range(1, self.world_size):
                self._ranks[rank] = _Rank(rank, self._spawn(rank), time.monotonic())
        self._thread = threading.Thread(target=self._supervise, name="dgpp-workers", daemon=True)
        self._thread.start()

    def pids(self) -> dict[int, int]:
        with self._lock:
            return {rank: entry.process.pid for rank, entry in self._ranks.items()}

    def restarts(self) -> dict[int, int]:
        with self._lock:
            return {rank: entry.restarts for rank, entry in self._ranks.items()}

    def stop(self) -> None:
        """SIGTERM every worker, then SIGKILL what is left after `shutdown_s`."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            processes = [entry.process for entry in self._ranks.values()]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.timeouts.shutdown_s
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not stop in time; killing it", process.pid)
                process.kill()
                process.wait()
        if self._watchdog is not None:
            self._watchdog.close()

    def _spawn(self, rank: int) -> subprocess.Popen[bytes]:
        watchdog = self._watchdog.environment() if self._watchdog is not None else {}
        env = {**os.environ, **secret_env(self.secret), **watchdog}
        process = subprocess.Popen(self.command(rank), env=env, preexec_fn=self._die_with_head)
        log.info("started rank %d (pid %d)", rank, process.pid)
        return process

    def _die_with_head(self) -> None:
        """In a worker's child process: the kernel sends it SIGTERM (an orderly stop) when the
        thread that started it goes away, the whole `dgpp serve` killed included. Without it a
        SIGKILLed rank 0 left its workers running, unsupervised and holding their weights (one
        that lost rank 1's seat to the next `dgpp serve`'s own worker kept waiting for a world).
        Workers start from the main thread or the supervisor's, which both live until `stop`.
        A head that died between the fork and here sent nothing: the child is an orphan already
        (re-parented), and leaves at once."""
        self._prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self._head_pid:
            os._exit(1)

    def _supervise(self) -> None:
        last = time.monotonic()
        while not self._stopping.wait(_POLL_S):
            if self._watchdog is not None:
                self._watchdog.drain()
            with self._lock:
                now = time.monotonic()
                if now - last > _POLL_S + _STALL_S and self._watchdog is not None:
                    # This process did not run either (the machine stalled, or it was stopped):
                    # the ranks' pings may still be on their way; give them one ping interval.
                    self._grace_until = now + self._watchdog.timeout_s / 3 + _POLL_S
                for entry in self._ranks.values():
                    self._check(entry)
                last = time.monotonic()

    def _check(self, entry: _Rank) -> None:
        now = time.monotonic()
        code = entry.process.poll()
        if code is None:
            self._enforce_watchdog(entry)
            return
        if entry.restart_at is None:
            # A rank that refuses its configuration will refuse it again soon: retry slowly.
            delay = self.restart_delay_s * (20 if code == EXIT_CONFIG else 1)
            log.warning(
                "rank %d (pid %d) exited with %d; restarting in %.1f s",
                entry.rank,
                entry.process.pid,
                code,
                delay,
            )
            entry.restart_at = now + delay
            if self._watchdog is not None:
                self._watchdog.forget(entry.process.pid)
        elif now >= entry.restart_at and not self._stopping.is_set():
            entry.process = self._spawn(entry.rank)
            entry.started, entry.restart_at = now, None
            entry.restarts += 1

    def _enforce_watchdog(self, entry: _Rank) -> None:
        """SIGKILL a live rank that has not pinged for the watchdog's timeout (a stopped
        process holds every other signal until it runs again); `_check` restarts it."""
        if self._watchdog is None or self._stopping.is_set():
            return
        if time.monotonic() < self._grace_until:
            return
        silent = self._watchdog.silent_for(entry.process.pid)
        if silent is None or silent <= self._watchdog.timeout_s:
            return
        status = self._watchdog.status.get(entry.process.pid, "no status")
        log.warning(
            "rank %d (pid %d) sent no watchdog ping for %.0f s (frozen? last status: %s); "
            "killing it",
            entry.rank,
            entry.process.pid,
            silent,
            status,
        )
        entry.process.kill()
        self._watchdog.forget(entry.process.pid)
