"""The local control backend: one `dgpp serve --deployment FILE` child process (rank 0, which
supervises its own local workers), for a development box or a single machine without systemd.

Rank 0's standard output and error go to `output_path` (truncated at each start, the previous
run's kept beside it as `<name>.previous`), so a start that fails before rank 0 opens its log
file (a bad model reference, a knob the engine refuses) still leaves its reason to read."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from dgpp.appliance.control_backend import ActionResult, RankStatus, read_tail


class LocalBackend:
    kind = "local"

    def __init__(
        self,
        deployment_path: Path,
        output_path: Path,
        command: Sequence[str] | None = None,
        stop_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self._deployment_path = deployment_path
        self.output_path = output_path
        # The child runs this interpreter's dgpp, whatever `dgpp` is first on PATH.
        self.command = tuple(command or (sys.executable, "-m", "dgpp.appliance.cli", "serve"))
        self.stop_timeout_s = stop_timeout_s
        self.env = env
        self._process: subprocess.Popen[bytes] | None = None
        self._started_at: float | None = None
        self._lock = threading.Lock()

    @property
    def deployment_path(self) -> Path:
        return self._deployment_path

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def start(self) -> ActionResult:
        with self._lock:
            return self._start()

    def stop(self) -> ActionResult:
        with self._lock:
            return self._stop()

    def restart(self) -> ActionResult:
        with self._lock:
            stopped = self._stop()
            if not stopped.ok:
                return stopped
            return self._start()

    def _start(self) -> ActionResult:
        if self._process is not None and self._process.poll() is None:
            return ActionResult(True, f"rank 0 is already running (pid {self._process.pid})")
        self.output_path.parent.mkdir(parents=True, exist_ok=True)
        if self.output_path.exists():
            os.replace(
                self.output_path, self.output_path.with_name(self.output_path.name + ".previous")
            )
        argv = [*self.command, "--deployment", str(self._deployment_path)]
        with self.output_path.open("wb") as output:
            try:
                # A session of its own: the console's terminal signals do not reach the engine,
                # and a stop that times out can kill rank 0 and its workers as one group.
                self._process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=self.env if self.env is not None else dict(os.environ),
                    start_new_session=True,
                )
            except OSError as err:
                return ActionResult(False, f"cannot start {argv[0]}: {err}")
        self._started_at = time.time()
        return ActionResult(True, f"started rank 0 (pid {self._process.pid})")

    def _stop(self) -> ActionResult:
        process = self._process
        if process is None or process.poll() is not None:
            return ActionResult(True, "rank 0 is not running")
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
            return ActionResult(True, f"rank 0 did not stop in {self.stop_timeout_s:.0f} s; killed")
        self._reap_group(process.pid)
        return ActionResult(True, f"rank 0 stopped (exit code {code})")

    def _reap_group(self, pgid: int) -> None:
        """Workers that outlived rank 0's orderly stop go with its process group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def status(self) -> list[RankStatus]:
        process = self._process
        if process is None:
            return [RankStatus(0, "stopped", detail="not started")]
        code = process.poll()
        if code is not None:
            state = "stopped" if code in (0, -signal.SIGTERM) else "failed"
            return [RankStatus(0, state, detail=f"exit code {code}")]
        ranks = [RankStatus(0, "running", pid=process.pid, started_at=self._started_at)]
        return ranks + _worker_statuses(process.pid)

    def exit_code(self) -> int | None:
        """Rank 0's exit code once it has exited; None while running or never started."""
        process = self._process
        return process.poll() if process is not None else None

    def log_tail(self, rank: int, lines: int) -> str:
        if rank == 0:
            return read_tail(self.output_path, lines)
        folder = _log_folder(self._deployment_path)
        return read_tail(folder / f"rank{rank}.log", lines) if folder is not None else ""


def _worker_statuses(pid: int) -> list[RankStatus]:
    """Ranks 1.. among rank 0's children (`dgpp rank --rank N`)."""
    statuses = []
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for child in children:
        try:
            argv = child.cmdline()
            started = child.create_time()
        except psutil.Error:
            continue
        if "--rank" in argv[:-1]:
            rank_text = argv[argv.index("--rank") + 1]
            if rank_text.isdigit():
                statuses.append(RankStatus(int(rank_text), "running", child.pid, started))
    return sorted(statuses, key=lambda status: status.rank)


def _log_folder(deployment_path: Path) -> Path | None:
    """The deployment's log folder (named by its id), or None when the file does not resolve."""
    from dgpp.appliance.deployment_files import deployment_id, resolve
    from dgpp.appliance.paths import deployment_log_dir
    from dgpp.engine.errors import ConfigError

    try:
        return deployment_log_dir(deployment_id(resolve(deployment_path)))
    except ConfigError:
        return None
