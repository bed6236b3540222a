"""`units/dgpp-tune` (POSIX sh, run by /bin/sh as the unit does) against a staged sysfs under
DGPP_SYSFS_ROOT and a recording `nvidia-smi` stand-in: this machine has no GPU, so the test
checks the command the script runs, not its effect on clocks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "units" / "dgpp-tune"
CPUS = 4


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """CPUs 0..3 with cpufreq (ondemand, 2.4 GHz max) and a CPU 4 without it."""
    root = tmp_path / "sysfs"
    for cpu in range(CPUS):
        folder = root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq"
        folder.mkdir(parents=True)
        (folder / "scaling_governor").write_text("ondemand\n")
        (folder / "scaling_max_freq").write_text("2400000\n")
    (root / "sys/devices/system/cpu/cpu4").mkdir()
    return root


def _smi(tmp_path: Path, exit_code: int = 0) -> tuple[Path, Path]:
    """A stand-in for nvidia-smi that records its arguments."""
    record = tmp_path / "nvidia-smi.calls"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$*" >> "{record}"\nexit {exit_code}\n')
    smi.chmod(0o755)
    return smi, record


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin"}
    return subprocess.run(["/bin/sh", str(SCRIPT)], env=base | env, capture_output=True, text=True)


def _values(sysfs: Path, name: str) -> set[str]:
    folders = sysfs.glob("sys/devices/system/cpu/cpu*/cpufreq")
    return {(folder / name).read_text().strip() for folder in folders}


def test_applies_every_requested_setting(sysfs: Path, tmp_path: Path) -> None:
    smi, record = _smi(tmp_path)
    result = _run(
        {
            "DGPP_SYSFS_ROOT": str(sysfs),
            "DGPP_NVIDIA_SMI": str(smi),
            "DGPP_GPU_CLOCKS": "1000,2100",
            "DGPP_CPU_GOVERNOR": "performance",
            "DGPP_CPU_MAX_FREQ_KHZ": "3000000",
        }
    )
    assert result.returncode == 0, result.stderr
    assert record.read_text() == "-lgc 1000,2100\n"
    assert _values(sysfs, "scaling_governor") == {"performance"}
    assert _values(sysfs, "scaling_max_freq") == {"3000000"}
    assert f"CPU scaling_governor set to performance on {CPUS} CPUs" in result.stdout


def test_nothing_requested_changes_nothing(sysfs: Path, tmp_path: Path) -> None:
    smi, record = _smi(tmp_path)
    result = _run({"DGPP_SYSFS_ROOT": str(sysfs), "DGPP_NVIDIA_SMI": str(smi)})
    assert result.returncode == 0, result.stderr
    assert not record.exists()
    assert _values(sysfs, "scaling_governor") == {"ondemand"}
    assert _values(sysfs, "scaling_max_freq") == {"2400000"}


def test_a_host_without_nvidia_smi_or_cpufreq_is_skipped(tmp_path: Path) -> None:
    result = _run(
        {
            "DGPP_SYSFS_ROOT": str(tmp_path / "empty"),
            "DGPP_NVIDIA_SMI": str(tmp_path / "no-such-nvidia-smi"),
            "DGPP_GPU_CLOCKS": "1000,2100",
            "DGPP_CPU_GOVERNOR": "performance",
        }
    )
    assert result.returncode == 0, result.stderr
    assert "not found (no NVIDIA driver here); skipped" in result.stdout
    assert "CPU scaling_governor: no cpufreq on this host; skipped" in result.stdout


def test_a_failing_setting_fails_the_unit_after_the_others(sysfs: Path, tmp_path: Path) -> None:
    smi, _ = _smi(tmp_path, exit_code=9)
    result = _run(
        {
            "DGPP_SYSFS_ROOT": str(sysfs),
            "DGPP_NVIDIA_SMI": str(smi),
            "DGPP_GPU_CLOCKS": "1000,2100",
            "DGPP_CPU_GOVERNOR": "performance",
        }
    )
    assert result.returncode == 1
    assert "-lgc 1000,2100 failed" in result.stderr
    assert _values(sysfs, "scaling_governor") == {"performance"}  # still applied


def test_an_unwritable_cpufreq_file_fails(sysfs: Path) -> None:
    # A directory where the file should be: unwritable even for root, who ignores modes.
    target = sysfs / "sys/devices/system/cpu/cpu2/cpufreq/scaling_max_freq"
    target.unlink()
    target.mkdir()
    result = _run({"DGPP_SYSFS_ROOT": str(sysfs), "DGPP_CPU_MAX_FREQ_KHZ": "3000000"})
    assert result.returncode == 1
    assert f"cannot write 3000000 to {target.parent}/scaling_max_freq" in result.stderr
    assert "set to" not in result.stdout


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DGPP_GPU_CLOCKS", "1000"),
        ("DGPP_GPU_CLOCKS", "1000,2100,3000"),
        ("DGPP_GPU_CLOCKS", "fast,faster"),
        ("DGPP_CPU_MAX_FREQ_KHZ", "3GHz"),
    ],
)
def test_malformed_settings_are_refused(sysfs: Path, tmp_path: Path, name: str, value: str) -> None:
    smi, record = _smi(tmp_path)
    result = _run({"DGPP_SYSFS_ROOT": str(sysfs), "DGPP_NVIDIA_SMI": str(smi), name: value})
    assert result.returncode == 1
    assert f"{name}={value} is not" in result.stderr
    assert not record.exists()
    assert _values(sysfs, "scaling_max_freq") == {"2400000"}
