"""The node's GPUs as `nvidia-smi -q` prints them, and their clock and power health.

A GPU busy (utilization >= 50%) whose SM clock sits below half its maximum, or whose enforced
power limit is below half its default, is the mark of a DGX Spark whose USB-PD negotiation went
wrong: the GPU stays at 500-850 MHz until the node is power-cycled (a reboot keeps it). Active
hardware slowdowns are reported as warnings. GB10 prints many fields as "N/A" (its memory is the
host's, its power is read elsewhere); a field that is not a number is unknown, never an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from dgpp.appliance.doctor.check import Check
from dgpp.appliance.doctor.probe import Probe

BUSY_PCT = 50  # utilization from which a GPU's clock must be near its maximum
MIN_CLOCK_RATIO = 0.5  # SM clock / maximum SM clock below this while busy: throttled
MIN_POWER_RATIO = 0.5  # enforced / default power limit below this: throttled
POWER_CYCLE_FIX = (
    "power-cycle the node (a USB-PD negotiation that went wrong keeps the GPU at 500-850 MHz "
    "until a cold power cycle): shut it down, unplug the power for 30 s, start it again"
)
SLOWDOWN_FIX = (
    "the hardware slows the GPU down: check the cooling (airflow, dust) and the power adapter; "
    "power-cycle the node if it persists while the GPU is cool"
)
# Clocks-event reasons (called "Clocks Throttle Reasons" before driver 535) that warn when active.
SLOWDOWNS = ("HW Slowdown", "HW Thermal Slowdown", "HW Power Brake Slowdown")
_GPU_HEADER = re.compile(r"^GPU [0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")
_NUMBER = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*(%|MHz|W)?$")


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    bus_id: str
    utilization_pct: float | None = None
    sm_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    power_limit_w: float | None = None  # the enforced limit
    default_power_limit_w: float | None = None
    slowdowns: tuple[str, ...] | None = None  # the active ones among SLOWDOWNS; None: unread
    is_integrated: bool = False  # shares the host's memory (GB10: Addressing Mode ATS)
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class GpuInventory:
    gpus: tuple[Gpu, ...] = ()
    reason: str = ""  # why there are none ("no GPU (nvidia-smi not found)")

    @property
    def is_integrated(self) -> bool | None:
        """Whether the node's GPU memory is its host memory; None without a GPU."""
        return any(gpu.is_integrated for gpu in self.gpus) if self.gpus else None


def parse_query(text: str) -> list[dict[str, str]]:
    """Each GPU section of `nvidia-smi -q` as {"Clocks/SM": "2411 MHz", ...}: a key is its
    section headers and name joined by "/", the old "Clocks Throttle Reasons" read as "Clocks
    Event Reasons" and "Power Readings" as "GPU Power Readings"."""
    sections: list[dict[str, str]] = []
    headers: list[tuple[int, str]] = []  # (indent, name) of the enclosing sections
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip():
            continue
        if _GPU_HEADER.match(line):
            sections.append({"Bus Id": line[4:]})
            headers = []
            continue
        if not sections or not line.startswith(" "):
            continue
        indent = len(line) - len(line.lstrip())
        while headers and headers[-1][0] >= indent:
            headers.pop()
        name, colon, value = line.strip().partition(":")
        name = _SECTION_NAMES.get(name.strip(), name.strip())
        if not colon:
            headers.append((indent, name))
            continue
        key = "/".join([*(header for _, header in headers), name])
        sections[-1].setdefault(key, value.strip())
    return sections


_SECTION_NAMES = {
    "Clocks Throttle Reasons": "Clocks Event Reasons",
    "Power Readings": "GPU Power Readings",
}


def number(value: str | None) -> float | None:
    """ "96 %", "2411 MHz", "41.23 W" as a number; "N/A", "[Not Supported]" and others None."""
    match = _NUMBER.match((value or "").strip())
    return float(match.group(1)) if match else None


def gpu_of(index: int, fields: dict[str, str]) -> Gpu:
    def first(*keys: str) -> float | None:
        return next((v for key in keys if (v := number(fields.get(key))) is not None), None)

    name = fields.get("Product Name", "unknown GPU")
    reasons = "Clocks Event Reasons/"
    capability = _capability(fields.get("Compute Capability", ""))
    return Gpu(
        index=index,
        name=name,
        bus_id=fields.get("Bus Id", "?"),
        utilization_pct=first("Utilization/GPU", "Utilization/Gpu"),
        sm_clock_mhz=first("Clocks/SM", "Clocks/Graphics"),
        max_sm_clock_mhz=first("Max Clocks/SM", "Max Clocks/Graphics"),
        power_limit_w=first(
            "GPU Power Readings/Current Power Limit",
            "GPU Power Readings/Enforced Power Limit",
            "GPU Power Readings/Power Limit",
        ),
        default_power_limit_w=first("GPU Power Readings/Default Power Limit"),
        slowdowns=tuple(s for s in SLOWDOWNS if fields.get(reasons + s, "").lower() == "active")
        if reasons + SLOWDOWNS[0] in fields
        else None,
        is_integrated=fields.get("Addressing Mode", "").upper() == "ATS" or "GB10" in name,
        capability=capability,
    )


def _capability(text: str) -> tuple[int, int] | None:
    match = re.fullmatch(r"\s*([0-9]+)\.([0-9]+)\s*", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def read_gpus(probe: Probe) -> GpuInventory:
    """The node's GPUs, or none with the reason (no driver, no device, unreadable output)."""
    query = probe.run("nvidia-smi", "-q")
    if query.text is None:
        return GpuInventory(reason=f"no GPU ({query.reason})")
    sections = parse_query(query.text)
    if not sections:
        said = query.text.strip().splitlines()[:1]
        return GpuInventory(reason=f"no GPU (nvidia-smi -q: {said[0] if said else 'no output'})")
    gpus = [gpu_of(index, fields) for index, fields in enumerate(sections)]
    if any(gpu.capability is None for gpu in gpus):
        # `-q` does not print the compute capability; the query interface does (driver >= 510).
        caps = probe.run("nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader")
        lines = (caps.text or "").split()
        if len(lines) == len(gpus):
            gpus = [
                gpu if gpu.capability else replace(gpu, capability=_capability(line))
                for gpu, line in zip(gpus, lines, strict=True)
            ]
    return GpuInventory(tuple(gpus))


def gpu_checks(inventory: GpuInventory) -> list[Check]:
    if not inventory.gpus:
        return [Check("gpu", "unknown", inventory.reason or "no GPU")]
    checks = []
    for gpu in inventory.gpus:
        checks += [_device(gpu), _clocks(gpu), _power_limit(gpu), _slowdown(gpu)]
    return checks


def _device(gpu: Gpu) -> Check:
    capability = (
        f"compute capability {gpu.capability[0]}.{gpu.capability[1]}"
        if gpu.capability
        else "compute capability unknown"
    )
    memory = "integrated (unified memory)" if gpu.is_integrated else "discrete memory"
    return Check(
        f"gpu{gpu.index}.device", "pass", f"{gpu.name} at {gpu.bus_id}, {capability}, {memory}"
    )


def _clocks(gpu: Gpu) -> Check:
    name = f"gpu{gpu.index}.clocks"
    busy, clock, peak = gpu.utilization_pct, gpu.sm_clock_mhz, gpu.max_sm_clock_mhz
    if busy is None or clock is None or peak is None or peak <= 0:
        missing = [
            label
            for label, value in (("utilization", busy), ("SM clock", clock), ("max SM clock", peak))
            if value is None
        ]
        return Check(
            name, "unknown", f"nvidia-smi reports no {', '.join(missing) or 'max SM clock'}"
        )
    measured = f"SM clock {clock:.0f} of {peak:.0f} MHz at {busy:.0f}% utilization"
    if busy < BUSY_PCT:
        return Check(name, "pass", f"{measured} (idle: the clock is judged under load)")
    if clock < MIN_CLOCK_RATIO * peak:
        return Check(
            name,
            "fail",
            f"{measured}: below {MIN_CLOCK_RATIO:.0%} of its maximum while busy",
            POWER_CYCLE_FIX,
        )
    return Check(name, "pass", measured)


def _power_limit(gpu: Gpu) -> Check:
    name = f"gpu{gpu.index}.power_limit"
    limit, default = gpu.power_limit_w, gpu.default_power_limit_w
    if limit is None or default is None or default <= 0:
        return Check(name, "unknown", "nvidia-smi reports no enforced or default power limit (N/A)")
    measured = f"enforced power limit {limit:.0f} W of a default {default:.0f} W"
    if limit < MIN_POWER_RATIO * default:
        return Check(name, "fail", f"{measured}: below {MIN_POWER_RATIO:.0%}", POWER_CYCLE_FIX)
    return Check(name, "pass", measured)


def _slowdown(gpu: Gpu) -> Check:
    name = f"gpu{gpu.index}.slowdown"
    if gpu.slowdowns is None:
        return Check(name, "unknown", "nvidia-smi reports no clocks-event reasons")
    if gpu.slowdowns:
        return Check(
            name, "warn", f"active clocks-event reasons: {', '.join(gpu.slowdowns)}", SLOWDOWN_FIX
        )
    return Check(name, "pass", "no hardware slowdown active")
