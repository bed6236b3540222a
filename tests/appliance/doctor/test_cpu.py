"""The CPU checks on recorded cpufreq trees of a DGX Spark (10 Cortex-X925 at ~3.9 GHz, 10
Cortex-A725 at ~2.8 GHz), healthy and capped at 1.5 GHz by its firmware."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.appliance.doctor.cpu import cpu_checks, rated_above_cap
from dgpp.appliance.doctor.probe import Probe
from tests.appliance.doctor.node import spark_root


def by_name(checks: list) -> dict:
    return {check.name: check for check in checks}


def set_all(root: Path, name: str, value: str) -> None:
    for folder in root.glob("sys/devices/system/cpu/cpu*/cpufreq"):
        (folder / name).write_text(value + "\n")


def test_a_healthy_spark_passes(tmp_path: Path) -> None:
    checks = by_name(cpu_checks(Probe(spark_root(tmp_path))))
    assert checks["cpu.governor"].status == "pass"
    assert checks["cpu.governor"].detail == "performance on 20 CPUs"
    assert checks["cpu.frequency_cap"].status == "pass"
    assert "2.81-3.90 GHz" in checks["cpu.frequency_cap"].detail


def test_a_spark_held_at_1_5_ghz_under_performance_warns(tmp_path: Path) -> None:
    root = spark_root(tmp_path, "cpufreq_spark_capped.txt")
    check = by_name(cpu_checks(Probe(root)))["cpu.frequency_cap"]
    assert check.status == "warn"
    assert "1.50-1.50 GHz of 2.81-3.90 GHz" in check.detail
    assert check.fix.startswith("check the firmware's CPU cap (DGX Spark")


def test_a_maximum_capped_at_1_5_ghz_on_a_faster_part_warns(tmp_path: Path) -> None:
    root = spark_root(tmp_path)
    set_all(root, "cpuinfo_max_freq", "1500000")
    check = by_name(cpu_checks(Probe(root)))["cpu.frequency_cap"]
    assert check.status == "warn" and "Cortex-X925" in check.detail


def test_a_bios_limit_below_the_scaling_maximum_warns(tmp_path: Path) -> None:
    root = spark_root(tmp_path)
    set_all(root, "bios_limit", "2000000")
    check = by_name(cpu_checks(Probe(root)))["cpu.frequency_cap"]
    assert check.status == "warn" and "bios_limit 2.00 GHz" in check.detail


def test_another_governor_warns_with_the_role(tmp_path: Path) -> None:
    root = spark_root(tmp_path)
    set_all(root, "scaling_governor", "schedutil")
    check = by_name(cpu_checks(Probe(root)))["cpu.governor"]
    assert check.status == "warn" and "20 of 20 CPUs" in check.detail
    assert "dgpp_cpu_governor" in check.fix


def test_no_cpufreq_is_unknown(tmp_path: Path) -> None:
    (check,) = cpu_checks(Probe(tmp_path))
    assert check.status == "unknown" and "no cpufreq" in check.detail


def test_garbled_cpufreq_files_are_unknown(tmp_path: Path) -> None:
    root = spark_root(tmp_path)
    for name in ("scaling_governor", "scaling_max_freq", "cpuinfo_max_freq", "scaling_cur_freq"):
        set_all(root, name, "")
    checks = by_name(cpu_checks(Probe(root)))
    assert checks["cpu.governor"].status == "unknown"
    assert checks["cpu.frequency_cap"].status == "unknown"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_cpuinfo_text_is_read_without_exceptions(text: str) -> None:
    rated_above_cap(text)
    rated_above_cap("model name\t: Some CPU @ " + text + "GHz")
