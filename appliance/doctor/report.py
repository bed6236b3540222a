"""A node's whole report: every check in a fixed order (gpu, toolchain, memory, cpu, rdma,
engine), as text for the operator or JSON for the console and the playbook."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dgpp.appliance.doctor.check import Check, exit_code
from dgpp.appliance.doctor.cpu import cpu_checks
from dgpp.appliance.doctor.engine_state import default_url, engine_checks, link_gbps
from dgpp.appliance.doctor.gpu import gpu_checks, read_gpus
from dgpp.appliance.doctor.memory import DEFAULT_OS_FLOOR_GIB, memory_checks
from dgpp.appliance.doctor.probe import Probe
from dgpp.appliance.doctor.toolchain import toolchain_checks

LABELS = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "unknown": "UNKNOWN"}
STATUS_OF_CODE = ("pass", "warn", "fail")


@dataclass(frozen=True)
class Options:
    url: str | None = None  # the head; None: this node's (`default_url`)
    api_key: str | None = None
    interface: str | None = None  # the cluster interface, for the rdma checks
    os_floor_gib: float = DEFAULT_OS_FLOOR_GIB


RdmaChecks = Callable[[Probe, str | None], list[Check]]


def run_checks(probe: Probe, options: Options, rdma: RdmaChecks | None = None) -> list[Check]:
    """Every check of the node; `rdma` is left out where that module is not installed."""
    inventory = read_gpus(probe)
    checks = gpu_checks(inventory)
    checks += _guarded("toolchain", lambda: toolchain_checks(inventory, probe.env))
    checks += _guarded(
        "memory", lambda: memory_checks(probe, inventory.is_integrated, 0.0, options.os_floor_gib)
    )
    checks += _guarded("cpu", lambda: cpu_checks(probe))
    if rdma is not None:
        checks += _guarded("rdma", lambda: rdma(probe, options.interface))
    url = options.url or default_url(probe)
    rate = link_gbps(probe, options.interface)
    checks += _guarded("engine", lambda: engine_checks(url, options.api_key, rate))
    return checks


def _guarded(name: str, run: Callable[[], list[Check]]) -> list[Check]:
    """A check's findings; a bug in one check is its own unknown, never the report's end."""
    try:
        return run()
    except Exception as err:
        return [Check(name, "unknown", f"the {name} check failed: {err!r}")]


def render_text(checks: list[Check]) -> str:
    width = max((len(check.name) for check in checks), default=0)
    lines = []
    for check in checks:
        lines.append(f"{LABELS[check.status]:<7}  {check.name:<{width}}  {check.detail}")
        if check.fix:
            lines.append(f"{'':<7}  {'':<{width}}  fix: {check.fix}")
    code = exit_code(checks)
    lines.append(f"status: {STATUS_OF_CODE[code]} (exit {code})")
    return "\n".join(lines) + "\n"


def render_json(checks: list[Check]) -> str:
    code = exit_code(checks)
    body: Mapping[str, object] = {
        "checks": [check.to_json() for check in checks],
        "status": STATUS_OF_CODE[code],
        "exit_code": code,
    }
    return json.dumps(body, indent=2) + "\n"
