"""The local control backend: one `dgpp serve --deployment FILE` child process (rank 0, which
supervises its own local workers), for a development box or a single machine without systemd.

Rank 0's standard output and error (its workers' too) go to `output_path`, so a start that fails
before rank 0 opens its log file (a bad model reference, a knob the engine refuses) still leaves
its reason to read. Each start rotates the earlier runs' files (`rank0.log` -> `rank0.log.1` ...
`rank0.log.5`, the oldest dropped) and begins the new file with one line of its own: when the run
started and what it ran, which is also where `log_runs` reads a run's start time."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from dgpp.appliance.common.log_format import log_time, parse_log_time
from dgpp.appliance.control.backend import ActionResult, LogRun, RankStatus, read_tail

KEPT_RUNS = 5  # earlier runs' output files kept beside the current one
_START_MARK = " console: starting "  # the first line of each output file, after its timestamp


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
        self._rotate()
        argv = [*self.command, "--deployment", str(self._deployment_path)]
        # Appending: rank 0 and the workers it starts share this file, each line at its end.
        with self.output_path.open("ab") as output:
            output.write(f"{log_time(time.time())}{_START_MARK}{shlex.join(argv)}\n".encode())
            output.flush()
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

    def run_path(self, index: int) -> Path:
        """Rank 0's output file of the run `index` starts back (0: the current one)."""
        name = self.output_path.name if index == 0 else f"{self.output_path.name}.{index}"
        return self.output_path.with_name(name)

    def _rotate(self) -> None:
        for index in range(KEPT_RUNS, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.run_path(index - 1), self.run_path(index))

    def log_runs(self, rank: int) -> list[LogRun]:
        """Rank 0's runs whose output files are here, newest first (ids "0" .. "5": how many
        starts back); the workers log into one file per deployment, so none for them."""
        if rank != 0:
            return []
        runs = []
        for index in range(KEPT_RUNS + 1):
            path = self.run_path(index)
            if path.exists():
                runs.append(LogRun(str(index), _started_at(path), is_current=index == 0))
        return runs

    def log_tail(self, rank: int, lines: int, run: str | None = None) -> str:
        if rank == 0:
            if run is None:
                return read_tail(self.output_path, lines)
            if run not in {str(index) for index in range(KEPT_RUNS + 1)}:
                return ""
            return read_tail(self.run_path(int(run)), lines)
        folder = _log_folder(self._deployment_path)
        if run is not None or folder is None:
            return ""
        return read_tail(folder / f"rank{rank}.log", lines)


def _started_at(path: Path) -> float | None:
    """When the run of an output file started, from its first line (None for a file that does
    not begin with the backend's own line)."""
    try:
        with path.open("rb") as handle:
            first = handle.readline(4096).decode(errors="replace")
    except OSError:
        return None
    stamp, mark, _ = first.partition(_START_MARK)
    return parse_log_time(stamp) if mark else None


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
    from dgpp.appliance.common.paths import deployment_log_dir
    from dgpp.appliance.deployments.files import deployment_id, resolve
    from dgpp.engine.errors import ConfigError

    try:
        return deployment_log_dir(deployment_id(resolve(deployment_path)))
    except ConfigError:
        return None
