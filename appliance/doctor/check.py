"""One finding of `dgpp doctor`: what was checked, how it stands and what the operator does.

A check reads tools and files that may be missing or print something unexpected; it then says
`unknown` with the reason, never raises. `exit_code` folds a report into the command's status:
0 healthy (pass and unknown only), 1 with a warning, 2 with a failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["pass", "warn", "fail", "unknown"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail", "unknown")


@dataclass(frozen=True)
class Check:
    name: str  # short and stable: "gpu.clocks", "rdma.nccl_hca", "cpu.frequency_cap"
    status: Status
    detail: str  # what was measured, in one line
    fix: str = ""  # what the operator does (empty on pass)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def exit_code(checks: Iterable[Check]) -> int:
    """0 when every check passed or is unknown, 1 with a warning, 2 with a failure."""
    statuses = {check.status for check in checks}
    return 2 if "fail" in statuses else 1 if "warn" in statuses else 0
