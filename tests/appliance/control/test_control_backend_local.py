"""The local control backend on a stand-in for `dgpp serve`: a small script that prints its
arguments (and $RUN), starts one "worker" child, and stops on SIGTERM (or exits with a given
code)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from dgpp.appliance.common.log_format import parse_log_time
from dgpp.appliance.common.paths import deployment_log_dir
from dgpp.appliance.control.local import KEPT_RUNS, LocalBackend
from dgpp.appliance.deployments.files import deployment_id, resolve

SERVE = """
import os, signal, subprocess, sys, time
print("serving", " ".join(sys.argv[1:]), "run", os.environ.get("RUN", "-"), flush=True)
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
idle = "import time; time.sleep(60)"
worker = subprocess.Popen([sys.executable, "-c", idle, "rank", "--rank", "1"])
def stop(*_):
    worker.terminate(); worker.wait(); print("stopped", flush=True); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(0.1)
"""


@pytest.fixture
def deployment(tmp_path: Path) -> Path:
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"model": "default"}))
    return path


def _backend(tmp_path: Path, deployment: Path, *extra: str) -> LocalBackend:
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    return LocalBackend(
        deployment,
        tmp_path / "state" / "rank0.log",
        command=(sys.executable, str(script), *extra),
        stop_timeout_s=10,
    )


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_start_status_restart_stop(tmp_path: Path, deployment: Path) -> None:
    backend = _backend(tmp_path, deployment)
    assert backend.status()[0].state == "stopped"
    assert backend.start().ok
    try:
        _wait(lambda: len(backend.status()) == 2)
        rank0, rank1 = backend.status()
        assert (rank0.rank, rank0.state, rank0.pid) == (0, "running", backend.pid)
        assert rank0.started_at is not None and rank1.rank == 1 and rank1.state == "running"
        _wait(lambda: "serving" in backend.log_tail(0, 5))
        assert f"--deployment {deployment}" in backend.log_tail(0, 5)
        first = backend.pid
        assert "already running" in backend.start().message
        assert backend.restart().ok
        assert backend.pid != first
        assert backend.run_path(1) == tmp_path / "state" / "rank0.log.1"
        assert "stopped" in backend.run_path(1).read_text()  # the orderly stop of the first run
        assert "stopped" not in backend.log_tail(0, 50)
        _wait(lambda: len(backend.status()) == 2)  # the new run's signal handler is in place
    finally:
        result = backend.stop()
    assert result.ok and result.message == "rank 0 stopped (exit code 0)"
    assert backend.status()[0].state == "stopped"


def test_rank_0_that_exits_with_an_error_is_failed(tmp_path: Path, deployment: Path) -> None:
    backend = _backend(tmp_path, deployment, "--exit", "3")
    backend.start()
    _wait(lambda: backend.exit_code() is not None)
    (status,) = backend.status()
    assert (status.state, status.detail) == ("failed", "exit code 3")
    assert "serving" in backend.log_tail(0, 10)
    assert backend.stop().message == "rank 0 is not running"


def test_worker_logs_come_from_the_deployment_folder(
    tmp_path: Path, deployment: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DGPP_LOG_DIR", str(tmp_path / "logs"))
    folder = deployment_log_dir(deployment_id(resolve(deployment)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rank1.log").write_text("one\ntwo\nthree\n")
    backend = _backend(tmp_path, deployment)
    assert backend.log_tail(1, 2) == "two\nthree"
    assert backend.log_tail(2, 2) == ""
    assert backend.log_runs(1) == []  # one file for every run of a worker
    assert backend.log_tail(1, 2, run="0") == ""


def test_each_start_keeps_the_earlier_runs_apart(tmp_path: Path, deployment: Path) -> None:
    backend = _backend(tmp_path, deployment, "--exit", "0")
    began = time.time()
    for run in range(KEPT_RUNS + 2):  # two more runs than are kept: the oldest two go
        backend.env = {**os.environ, "RUN": str(run)}
        assert backend.start().ok
        _wait(lambda: backend.exit_code() is not None)
    runs = backend.log_runs(0)
    assert [r.id for r in runs] == [str(index) for index in range(KEPT_RUNS + 1)]
    assert [r.is_current for r in runs] == [True] + [False] * KEPT_RUNS
    starts = [r.started_at for r in runs]
    assert all(s is not None and began - 1 <= s <= time.time() for s in starts)
    assert starts == sorted(starts, reverse=True)  # type: ignore[type-var]
    newest = KEPT_RUNS + 1
    for index in range(KEPT_RUNS + 1):  # run "k" is the one started k starts back
        assert f"run {newest - index}" in backend.log_tail(0, 5, run=str(index))
    assert backend.log_tail(0, 5) == backend.log_tail(0, 5, run="0")
    assert not (tmp_path / "state" / f"rank0.log.{KEPT_RUNS + 1}").exists()
    assert backend.log_tail(0, 5, run=str(KEPT_RUNS + 1)) == ""
    assert backend.log_tail(0, 5, run="../deployment.json") == ""


def test_the_output_begins_with_when_and_what_started(tmp_path: Path, deployment: Path) -> None:
    backend = _backend(tmp_path, deployment, "--exit", "0")
    before = time.time()
    backend.start()
    _wait(lambda: backend.exit_code() is not None)
    first, second = backend.output_path.read_text().splitlines()[:2]
    stamp, _, rest = first.partition(" ")
    started = parse_log_time(stamp)
    assert started is not None and before - 1 <= started <= time.time()
    assert "T" in stamp and rest.startswith("console: starting ")
    assert f"--deployment {deployment}" in rest
    assert second.startswith("serving ")
    assert backend.log_runs(0)[0].started_at == started
