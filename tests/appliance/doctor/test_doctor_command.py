"""`dgpp doctor` for real, in a subprocess of the installed CLI: exit 0 on a healthy recorded
Spark, 1 on a warning, 2 on a failure, `--json`'s shape, and this machine's own run. Fake
`nvidia-smi` executables on PATH and `--root` over recorded files stand in for a Spark's GPU
and sysfs, which this machine lacks."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from dgpp.appliance.doctor.check import Check
from dgpp.appliance.doctor.report import render_json, render_text
from tests.appliance.doctor.node import gpu_tools, node_env, spark_root

DGPP = Path(sys.executable).parent / "dgpp"


def unused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def doctor(root: Path, bin_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in node_env(bin_dir).items() if not k.startswith(("TRITON_PTXAS", "NCCL_"))
    }
    argv = [str(DGPP), "doctor", "--root", str(root), "--url", unused_url(), *flags]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)


def test_a_healthy_spark_exits_0(tmp_path: Path) -> None:
    gpu_tools(tmp_path / "bin", "gb10_healthy")
    done = doctor(spark_root(tmp_path / "root"), tmp_path / "bin")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS     gpu0.clocks" in done.stdout
    assert done.stdout.rstrip().endswith("status: pass (exit 0)")


def test_a_capped_cpu_exits_1_and_a_pd_throttled_gpu_2(tmp_path: Path) -> None:
    gpu_tools(tmp_path / "bin", "gb10_healthy")
    capped = spark_root(tmp_path / "capped", "cpufreq_spark_capped.txt")
    done = doctor(capped, tmp_path / "bin")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "WARN     cpu.frequency_cap" in done.stdout
    assert "fix: check the firmware's CPU cap" in done.stdout
    gpu_tools(tmp_path / "bin", "gb10_pd_throttled")
    done = doctor(capped, tmp_path / "bin", "--json")
    assert done.returncode == 2, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert (report["status"], report["exit_code"]) == ("fail", 2)
    assert set(report["checks"][0]) == {"name", "status", "detail", "fix"}
    names = [check["name"] for check in report["checks"]]
    assert names[:4] == ["gpu0.device", "gpu0.clocks", "gpu0.power_limit", "gpu0.slowdown"]
    order = [name.split(".")[0].rstrip("0123456789") for name in names]
    assert order == sorted(order, key=["gpu", "toolchain", "memory", "cpu", "rdma", "engine"].index)


def test_this_machine_exits_0_or_1_in_under_5_s() -> None:
    start = time.monotonic()
    done = subprocess.run([str(DGPP), "doctor"], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert done.returncode in (0, 1), done.stdout + done.stderr
    if shutil.which("nvidia-smi") is None:
        assert "no GPU" in done.stdout
    assert elapsed < 5.0, elapsed


def test_the_renderings() -> None:
    checks = [
        Check("gpu0.clocks", "fail", "SM clock 611 of 3003 MHz", "power-cycle the node"),
        Check("cpu", "unknown", "no cpufreq"),
    ]
    assert render_text(checks).splitlines() == [
        "FAIL     gpu0.clocks  SM clock 611 of 3003 MHz",
        "                      fix: power-cycle the node",
        "UNKNOWN  cpu          no cpufreq",
        "status: fail (exit 2)",
    ]
    assert json.loads(render_json(checks[1:])) == {
        "checks": [{"name": "cpu", "status": "unknown", "detail": "no cpufreq", "fix": ""}],
        "status": "pass",
        "exit_code": 0,
    }
