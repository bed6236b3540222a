"""The overview's Node health panel: `dgpp doctor`'s checks of the node the console runs on, run
in-process and kept for a minute.

The checks read files and run tools (nvidia-smi, ibv_devinfo, ip) each within a timeout, and ask
the engine's `/v1/metrics`: seconds, not something to repeat at every refresh of the page. They
run in a worker thread (`report` blocks), one run at a time; a caller that arrives during a run
waits for it and shares its report. A check that breaks is its own "unknown" finding, and so is
anything else that raises: the panel always has a report to show."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dgpp.appliance.doctor.check import Check, exit_code
from dgpp.appliance.doctor.probe import Probe
from dgpp.appliance.doctor.rdma import rdma_checks
from dgpp.appliance.doctor.report import LABELS, STATUS_OF_CODE, Options, run_checks

MAX_AGE_S = 60.0


@dataclass(frozen=True)
class HealthReport:
    checks: tuple[Check, ...]
    time: float  # when the checks ran
    options: Options  # what they ran with: other options (a switch to another port) run again

    def as_json(self) -> dict[str, Any]:
        """`dgpp doctor --json`'s body, each check with its badge (`label`) and the report's
        `time`."""
        code = exit_code(self.checks)
        return {
            "checks": [{**check.to_json(), "label": LABELS[check.status]} for check in self.checks],
            "status": STATUS_OF_CODE[code],
            "exit_code": code,
            "time": self.time,
        }


class NodeDoctor:
    """This node's doctor report, run again when older than `max_age_s` or asked `fresh`."""

    def __init__(
        self,
        probe: Probe | None = None,  # tests point one at a recorded node's root and tools
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.probe = probe or Probe()
        self.max_age_s = max_age_s
        self.clock = clock
        self._lock = threading.Lock()
        self._report: HealthReport | None = None

    def report(self, options: Options, fresh: bool = False) -> HealthReport:
        """The kept report when it is recent and ran with `options`, else a new one (blocks for
        the checks' run: call it in a thread)."""
        with self._lock:
            kept = self._report
            if (
                not fresh
                and kept is not None
                and kept.options == options
                and self.clock() - kept.time < self.max_age_s
            ):
                return kept
            checks = tuple(_checks(self.probe, options))
            self._report = HealthReport(checks, self.clock(), options)
            return self._report


def _checks(probe: Probe, options: Options) -> list[Check]:
    try:
        return run_checks(probe, options, rdma_checks)
    except Exception as err:  # each check guards itself; this is the report's own guard
        return [Check("doctor", "unknown", f"the node's checks failed: {err!r}")]
