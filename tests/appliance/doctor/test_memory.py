"""The memory checks on a recorded Spark `/proc/meminfo` (128 GB unified, large page cache)."""

from __future__ import annotations

import shutil
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.appliance.doctor.memory import memory_checks, parse_meminfo
from dgpp.appliance.doctor.probe import Probe, Reading
from tests.appliance.doctor.node import FIXTURES


def spark_probe(root: Path) -> Probe:
    (root / "proc").mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / "proc-meminfo_spark_page_cache.txt", root / "proc" / "meminfo")
    return Probe(root)


def test_a_spark_with_page_cache_passes_and_explains_memfree(tmp_path: Path) -> None:
    floor, cache = memory_checks(spark_probe(tmp_path), is_integrated=True)
    assert (floor.name, floor.status) == ("memory.os_floor", "pass")
    assert "MemAvailable 108.1 of 122.5 GiB" in floor.detail
    assert (cache.name, cache.status) == ("memory.page_cache", "pass")
    assert "MemFree 9.1 GiB" in cache.detail
    assert "cudaMemGetInfo reports MemFree" in cache.detail and "drop_page_cache" in cache.detail


def test_a_plan_that_leaves_the_os_less_than_its_floor_warns(tmp_path: Path) -> None:
    floor, _ = memory_checks(spark_probe(tmp_path), is_integrated=True, planned_gib=104.0)
    assert floor.status == "warn"
    assert "4.1 GiB left: below the OS floor of 6 GiB" in floor.detail
    assert "hangs the box" in floor.fix
    floor, _ = memory_checks(spark_probe(tmp_path), True, planned_gib=100.0, floor_gib=10.0)
    assert floor.status == "warn"


def test_a_discrete_gpu_or_none_only_reports(tmp_path: Path) -> None:
    for integrated, said in ((False, "memory of its own"), (None, "no GPU")):
        (check,) = memory_checks(spark_probe(tmp_path), is_integrated=integrated, planned_gib=500)
        assert check.status == "pass" and said in check.detail


def test_missing_or_garbled_meminfo_is_unknown(tmp_path: Path) -> None:
    (check,) = memory_checks(Probe(tmp_path), is_integrated=True)
    assert (check.status, check.detail) == ("unknown", "/proc/meminfo does not exist")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: lots\nMemFree: 1 kB\n")
    (check,) = memory_checks(Probe(tmp_path), is_integrated=True)
    assert (check.status, check.detail) == (
        "unknown",
        "/proc/meminfo has no MemTotal, MemAvailable",
    )


class TextProbe:
    """A probe whose every file reads `text`."""

    def __init__(self, text: str) -> None:
        self.text = text

    def read(self, path: str) -> Reading:
        return Reading(self.text)


@settings(max_examples=200, deadline=None)
@given(st.text(), st.sampled_from([True, False, None]))
def test_any_text_gives_findings_not_exceptions(text: str, integrated: bool | None) -> None:
    parse_meminfo(text)
    checks = memory_checks(TextProbe(text), integrated)  # type: ignore[arg-type]
    assert checks and all(check.status in ("pass", "warn", "unknown") for check in checks)
