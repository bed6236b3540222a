"""The GPU checks on recorded `nvidia-smi -q` output (fake nvidia-smi executables stand in for a
DGX Spark's GB10 and an H100, which this machine lacks)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.appliance.doctor.check import exit_code
from dgpp.appliance.doctor.gpu import gpu_checks, gpu_of, parse_query, read_gpus
from dgpp.appliance.doctor.probe import Probe
from tests.appliance.doctor.node import FIXTURES, fake_nvidia_smi, gpu_tools, probe


def statuses(checks: list) -> dict[str, str]:
    return {check.name: check.status for check in checks}


def test_a_healthy_spark_passes_and_is_integrated(tmp_path: Path) -> None:
    gpu_tools(tmp_path / "bin", "gb10_healthy")
    inventory = read_gpus(probe(tmp_path, tmp_path / "bin"))
    (gpu,) = inventory.gpus
    assert (gpu.name, gpu.capability, gpu.is_integrated) == ("NVIDIA GB10", (12, 1), True)
    assert inventory.is_integrated is True
    checks = gpu_checks(inventory)
    assert statuses(checks) == {
        "gpu0.device": "pass",
        "gpu0.clocks": "pass",
        "gpu0.power_limit": "unknown",  # GB10 prints its power limits as N/A
        "gpu0.slowdown": "pass",
    }
    assert "compute capability 12.1, integrated" in checks[0].detail
    assert exit_code(checks) == 0


def test_a_pd_throttled_spark_fails_with_power_cycle(tmp_path: Path) -> None:
    gpu_tools(tmp_path / "bin", "gb10_pd_throttled")
    checks = gpu_checks(read_gpus(probe(tmp_path, tmp_path / "bin")))
    (clocks,) = [check for check in checks if check.name == "gpu0.clocks"]
    assert clocks.status == "fail"
    assert "611 of 3003 MHz at 99%" in clocks.detail
    assert clocks.fix.startswith("power-cycle the node")
    assert exit_code(checks) == 2


def test_an_h100_passes_on_the_older_field_names(tmp_path: Path) -> None:
    gpu_tools(tmp_path / "bin", "h100")
    inventory = read_gpus(probe(tmp_path, tmp_path / "bin"))
    assert inventory.gpus[0].capability == (9, 0)
    assert inventory.is_integrated is False
    checks = gpu_checks(inventory)
    assert set(statuses(checks).values()) == {"pass"}
    assert "enforced power limit 700 W of a default 700 W" in checks[2].detail


def test_a_low_power_limit_fails_and_a_hardware_slowdown_warns() -> None:
    text = (FIXTURES / "nvidia-smi-q_h100.txt").read_text()
    text = text.replace(
        "Enforced Power Limit              : 700.00 W",
        "Enforced Power Limit              : 300.00 W",
    )
    text = text.replace(
        "Power Limit                       : 700.00 W",
        "Power Limit                       : 300.00 W",
    )
    text = text.replace(
        "HW Power Brake Slowdown       : Not Active", "HW Power Brake Slowdown       : Active"
    )
    checks = statuses(gpu_checks_of(text))
    assert checks["gpu0.power_limit"] == "fail"
    assert checks["gpu0.slowdown"] == "warn"


def test_an_idle_gpu_at_a_low_clock_passes() -> None:
    text = (FIXTURES / "nvidia-smi-q_gb10_pd_throttled.txt").read_text()
    text = text.replace(
        "GPU                                            : 99 %",
        "GPU                                            : 0 %",
    )
    assert statuses(gpu_checks_of(text))["gpu0.clocks"] == "pass"


def gpu_checks_of(text: str) -> list:
    from dgpp.appliance.doctor.gpu import GpuInventory

    sections = parse_query(text)
    return gpu_checks(GpuInventory(tuple(gpu_of(i, s) for i, s in enumerate(sections))))


def test_no_nvidia_smi_is_a_clean_no_gpu(tmp_path: Path) -> None:
    inventory = read_gpus(Probe(tmp_path, env={"PATH": str(tmp_path)}))
    assert inventory.gpus == () and inventory.is_integrated is None
    (check,) = gpu_checks(inventory)
    assert (check.name, check.status, check.detail) == (
        "gpu",
        "unknown",
        "no GPU (nvidia-smi not found)",
    )


def test_garbage_empty_and_failing_nvidia_smi_are_unknown(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.txt"
    garbage.write_bytes(b"\x00\xff NVIDIA-SMI has failed because it couldn't communicate\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for query in (garbage, empty, tmp_path / "absent.txt"):
        fake_nvidia_smi(tmp_path / "bin", query, None)
        (check,) = gpu_checks(read_gpus(probe(tmp_path, tmp_path / "bin")))
        assert (check.name, check.status) == ("gpu", "unknown")
        assert check.detail.startswith("no GPU")


def test_a_gpu_whose_fields_are_all_na_is_unknown_not_a_crash() -> None:
    text = "GPU 00000000:01:00.0\n    Product Name : X\n    Clocks\n        SM : N/A\n"
    checks = statuses(gpu_checks_of(text))
    assert checks["gpu0.clocks"] == "unknown"
    assert checks["gpu0.power_limit"] == "unknown"
    assert checks["gpu0.slowdown"] == "unknown"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_the_parser_never_raises_on_any_text(text: str) -> None:
    prefix = "GPU 00000000:01:00.0\n"
    for sample in (text, prefix + text):
        checks = gpu_checks_of(sample)
        assert all(check.status in ("pass", "warn", "fail", "unknown") for check in checks)
