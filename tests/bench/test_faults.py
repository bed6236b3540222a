"""The fault drills of bench/faults.py, short: every drill once, on the default model, in one run
(the drills share their servers), each drill's checks then asserted by a test of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

FAULTS = Path(__file__).resolve().parents[2] / "bench" / "faults.py"
DRILLS = [
    "queue_full",
    "kv_full",
    "disconnect",
    "slow_reader",
    "restart_rank0",
    "kill_worker",
    "stop_worker",
    "restart_rank0_world2",
    "console_switch",
]


@pytest.fixture(scope="module")
def report(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("faults")
    figures = folder / "faults.json"
    command = [sys.executable, str(FAULTS), "--model", str(default_checkpoint)]
    command += ["--json", str(figures), "--log-dir", str(folder / "logs")]
    command += ["--max-tokens", "16", "--request-timeout", "90"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=480)
    assert figures.is_file(), done.stdout + done.stderr
    drills = {drill["name"]: drill for drill in json.loads(figures.read_text())["drills"]}
    return {"drills": drills, "output": done.stdout + done.stderr, "returncode": done.returncode}


@pytest.mark.slow
@pytest.mark.parametrize("name", DRILLS)
def test_drill_passes(report: dict[str, Any], name: str) -> None:
    drill = report["drills"].get(name)
    assert drill is not None, report["output"]
    failed = [check for check, ok in drill["checks"].items() if not ok]
    assert not failed, f"{name}: {failed}\n{json.dumps(drill, indent=2)}"
    assert drill["end"]["kv_blocks_in_use"] == 0 and drill["end"]["running"] == 0


@pytest.mark.slow
def test_the_faults_were_seen(report: dict[str, Any]) -> None:
    """The drills exercised what they claim: refusals, cut streams with their error event,
    broken connections when rank 0 died, a switch that went through drain and restart."""
    drills = report["drills"]
    assert drills["queue_full"]["outcomes"].get("503 overloaded + Retry-After", 0) > 0
    assert drills["kv_full"]["figures"]["too_long_answer"] == "400 context_length_exceeded"
    for name in ("kill_worker", "stop_worker"):
        assert drills[name]["outcomes"].get("200 then error event engine_failure", 0) > 0
    assert drills["stop_worker"]["figures"]["while_stopped"]["health"] == "503 re-forming"
    for name in ("restart_rank0", "restart_rank0_world2"):
        assert drills[name]["figures"]["broken_connections"] > 0
    assert drills["console_switch"]["figures"]["job"].startswith("ready")
    assert report["returncode"] == 0, report["output"]
