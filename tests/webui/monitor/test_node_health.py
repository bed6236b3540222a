"""The console's doctor: a report kept `max_age_s` for the same options, run again for others or
when older, and a probe that raises turned into an "unknown" finding, never an exception."""

from __future__ import annotations

from pathlib import Path

from dgpp.appliance.doctor.probe import Probe, Reading
from dgpp.appliance.doctor.report import Options
from dgpp.webui.monitor.node_health import NodeDoctor
from tests.engine.server.harness import free_port


class _BrokenProbe(Probe):
    def run(self, *argv: str, timeout_s: float | None = None) -> Reading:
        raise RuntimeError("the tool table is corrupt")


def test_a_probe_that_raises_is_an_unknown_finding(tmp_path: Path) -> None:
    report = NodeDoctor(_BrokenProbe(tmp_path)).report(
        Options(url=f"http://127.0.0.1:{free_port()}")
    )
    (check,) = report.checks
    assert (check.name, check.status) == ("doctor", "unknown")
    assert "the tool table is corrupt" in check.detail
    body = report.as_json()
    assert (body["status"], body["exit_code"], body["checks"][0]["label"]) == ("pass", 0, "UNKNOWN")


def test_the_report_is_kept_for_the_same_options_until_it_is_old(tmp_path: Path) -> None:
    now = [1000.0]
    doctor = NodeDoctor(_BrokenProbe(tmp_path), max_age_s=60, clock=lambda: now[0])
    options = Options(url=f"http://127.0.0.1:{free_port()}")
    first = doctor.report(options)
    now[0] += 59
    assert doctor.report(options) is first
    assert doctor.report(Options(url=f"http://127.0.0.1:{free_port()}")) is not first
    kept = doctor.report(options)
    now[0] += 60
    assert doctor.report(options) is not kept
