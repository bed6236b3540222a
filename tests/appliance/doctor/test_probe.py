"""The probe reads files under its root and runs tools within a timeout; every miss is a reason,
never an exception."""

from __future__ import annotations

from pathlib import Path

from dgpp.appliance.doctor.probe import Probe
from tests.appliance.doctor.node import write_tool


def test_reads_under_the_root_and_globs_absolute_paths(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 1 kB\n")
    probe = Probe(tmp_path)
    assert probe.read("/proc/meminfo").text == "MemTotal: 1 kB\n"
    assert probe.glob("/proc/*") == ["/proc/meminfo"]
    missing = probe.read("/proc/cpuinfo")
    assert missing.text is None and "does not exist" in missing.reason
    assert probe.read("/proc").text is None  # a folder: a reason, not IsADirectoryError


def test_runs_a_tool_and_says_why_it_did_not(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    write_tool(bin_dir, "ok", "echo hello\n")
    write_tool(bin_dir, "bad", "echo 'No devices were found' ; exit 6\n")
    write_tool(bin_dir, "slow", "exec /bin/sleep 5\n")
    probe = Probe(tmp_path, timeout_s=0.3, env={"PATH": str(bin_dir)})
    assert probe.run("ok").text == "hello\n"
    assert probe.run("bad").reason == "bad exited 6: No devices were found"
    assert probe.run("slow").reason == "slow timed out after 0.3 s"
    assert probe.run("absent").reason == "absent not found"
