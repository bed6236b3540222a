"""The CPUs' frequency policy from cpufreq's sysfs (the kernel's admin-guide/pm/cpufreq): the
governor, and a maximum capped below what the governor asks.

A DGX Spark can keep its CPUs at 1.5 GHz whatever the governor says (a firmware or power setting).
The cap shows as a `bios_limit` below `scaling_max_freq`, as every CPU's `cpuinfo_max_freq` at
1.5 GHz or less on a part rated higher, or as every CPU's `scaling_cur_freq` far below
`scaling_max_freq` while the governor is `performance` (which holds the maximum).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from dgpp.appliance.doctor.check import Check
from dgpp.appliance.doctor.probe import Probe

CPUFREQ = "/sys/devices/system/cpu/cpu[0-9]*/cpufreq"
CAP_KHZ = 1_500_000  # a part rated higher whose every core's maximum is at most this is capped
MIN_CUR_RATIO = 0.6  # every CPU below this share of its maximum under `performance`: capped
# ARM parts (/proc/cpuinfo "CPU part", implementer 0x41) whose cores are rated above 1.5 GHz.
FAST_ARM_PARTS = {"0xd85": "Cortex-X925", "0xd87": "Cortex-A725", "0xd4f": "Neoverse-V2"}
CAP_FIX = (
    "check the firmware's CPU cap (DGX Spark: a firmware/power setting can keep the CPU at "
    "1.5 GHz whatever the governor says); update the firmware, check the power settings, and "
    "power-cycle the node"
)
GOVERNOR_FIX = (
    "set the performance governor: the dgpp_cpu_governor role (playbooks/roles/"
    "dgpp_cpu_governor) does it for every node, or `cpupower frequency-set -g performance`"
)


@dataclass(frozen=True)
class CpuFreq:
    cpu: str  # "cpu0"
    governor: str | None
    scaling_max_khz: int | None
    cpuinfo_max_khz: int | None
    cur_khz: int | None
    bios_limit_khz: int | None


def read_cpufreq(probe: Probe) -> list[CpuFreq]:
    def khz(folder: str, name: str) -> int | None:
        text = probe.read(f"{folder}/{name}").text
        return int(text.strip()) if text and text.strip().isdigit() else None

    cpus = []
    for folder in probe.glob(CPUFREQ):
        governor = probe.read(f"{folder}/scaling_governor").text
        cpus.append(
            CpuFreq(
                cpu=folder.split("/")[-2],
                governor=(governor.strip() or None) if governor else None,
                scaling_max_khz=khz(folder, "scaling_max_freq"),
                cpuinfo_max_khz=khz(folder, "cpuinfo_max_freq"),
                cur_khz=khz(folder, "scaling_cur_freq"),
                bios_limit_khz=khz(folder, "bios_limit"),
            )
        )
    return cpus


def rated_above_cap(cpuinfo: str) -> str | None:
    """The name of a part in /proc/cpuinfo known to run above 1.5 GHz, else None."""
    for part in re.findall(r"^CPU part\s*:\s*(0x[0-9a-fA-F]+)", cpuinfo, re.MULTILINE):
        if part.lower() in FAST_ARM_PARTS:
            return FAST_ARM_PARTS[part.lower()]
    for ghz in re.findall(r"^model name\s*:.*@\s*([0-9.]+)\s*GHz", cpuinfo, re.MULTILINE):
        try:
            if float(ghz) * 1_000_000 > CAP_KHZ:
                return f"a {ghz} GHz part"
        except ValueError:
            continue
    return None


def cpu_checks(probe: Probe) -> list[Check]:
    cpus = read_cpufreq(probe)
    if not cpus:
        detail = "no cpufreq in sysfs (a VM or container, or no cpufreq driver)"
        return [Check("cpu", "unknown", detail)]
    return [_governor(cpus), _frequency_cap(cpus, probe.read("/proc/cpuinfo").text or "")]


def _governor(cpus: list[CpuFreq]) -> Check:
    governors = sorted({cpu.governor or "unreadable" for cpu in cpus})
    if governors == ["performance"]:
        return Check("cpu.governor", "pass", f"performance on {len(cpus)} CPUs")
    if governors == ["unreadable"]:
        return Check("cpu.governor", "unknown", "scaling_governor unreadable")
    others = [cpu.cpu for cpu in cpus if cpu.governor != "performance"]
    detail = f"governor {', '.join(governors)}; {len(others)} of {len(cpus)} CPUs not performance"
    return Check("cpu.governor", "warn", detail, GOVERNOR_FIX)


def _frequency_cap(cpus: list[CpuFreq], cpuinfo: str) -> Check:
    name = "cpu.frequency_cap"
    bios = [
        c
        for c in cpus
        if c.bios_limit_khz and c.scaling_max_khz and c.bios_limit_khz < c.scaling_max_khz
    ]
    if bios:
        first = bios[0]
        detail = (
            f"bios_limit {_ghz(first.bios_limit_khz)} below scaling_max_freq "
            f"{_ghz(first.scaling_max_khz)} on {len(bios)} of {len(cpus)} CPUs"
        )
        return Check(name, "warn", detail, CAP_FIX)
    maxima = [c.cpuinfo_max_khz for c in cpus]
    part = rated_above_cap(cpuinfo)
    if part and all(m is not None and m <= CAP_KHZ for m in maxima):
        detail = f"cpuinfo_max_freq at most {_ghz(CAP_KHZ)} on every CPU of {part}"
        return Check(name, "warn", detail, CAP_FIX)
    pinned = [c for c in cpus if c.governor == "performance" and c.cur_khz and c.scaling_max_khz]
    if (
        pinned
        and len(pinned) == len(cpus)
        and all(c.cur_khz < MIN_CUR_RATIO * c.scaling_max_khz for c in pinned)
    ):
        detail = (
            f"every CPU runs far below its maximum under the performance governor: "
            f"{_spread(c.cur_khz for c in pinned)} of {_spread(c.scaling_max_khz for c in pinned)}"
        )
        return Check(name, "warn", detail, CAP_FIX)
    if not any(maxima) and not any(c.cur_khz for c in cpus):
        return Check(name, "unknown", "cpufreq reports no frequencies")
    return Check(name, "pass", f"maximum {_spread(m for m in maxima if m)}, no cap seen")


def _ghz(khz: int | None) -> str:
    return "?" if khz is None else f"{khz / 1e6:.2f} GHz"


def _spread(values: Iterable[int | None]) -> str:
    """ "3.90 GHz", or "2.81-3.90 GHz" for kHz values that differ."""
    numbers = sorted(v for v in values if v is not None)
    if not numbers:
        return "?"
    low, high = numbers[0], numbers[-1]
    return _ghz(low) if low == high else f"{low / 1e6:.2f}-{high / 1e6:.2f} GHz"
