"""Host memory as the engine sees it on an integrated GPU (`/proc/meminfo`, proc(5)).

On unified memory (DGX Spark's GB10) the GPU allocates from the host's RAM: `cudaMemGetInfo`
reports MemFree there, so reclaimable page cache looks used, while the engine sizes from
MemAvailable, which counts the cache as free. What the engine plans must leave the OS a floor
(`os_memory_floor_gib`, default 6 GiB): an out-of-memory on unified memory hangs the box instead of
failing.
"""

from __future__ import annotations

from dgpp.appliance.doctor.check import Check
from dgpp.appliance.doctor.probe import Probe

DEFAULT_OS_FLOOR_GIB = 6.0
# Reclaimable page cache (MemAvailable - MemFree) worth a line of its own.
LARGE_PAGE_CACHE_GIB = 8.0
GIB_KB = 1024 * 1024  # /proc/meminfo counts kB (KiB)
FLOOR_FIX = (
    "leave the OS its floor: stop other processes on the node or plan less memory (a smaller "
    "KV cache or model); on unified memory an out-of-memory hangs the box instead of failing, "
    "so the engine refuses a plan below os_memory_floor_gib"
)


def parse_meminfo(text: str) -> dict[str, int]:
    """`Name:  123 kB` lines as {name: kB}; lines of another shape are skipped."""
    values = {}
    for line in text.splitlines():
        name, colon, rest = line.partition(":")
        fields = rest.split()
        if colon and fields and fields[0].isdigit():
            values[name.strip()] = int(fields[0])
    return values


def memory_checks(
    probe: Probe,
    is_integrated: bool | None,
    planned_gib: float = 0.0,
    floor_gib: float = DEFAULT_OS_FLOOR_GIB,
) -> list[Check]:
    """`planned_gib`: what the engine will take of the host memory (weights and KV cache) beyond
    what it holds now; `is_integrated`: whether the GPU shares it (None: no GPU)."""
    reading = probe.read("/proc/meminfo")
    if reading.text is None:
        return [Check("memory", "unknown", reading.reason)]
    info = parse_meminfo(reading.text)
    missing = [name for name in ("MemTotal", "MemFree", "MemAvailable") if name not in info]
    if missing:
        return [Check("memory", "unknown", f"/proc/meminfo has no {', '.join(missing)}")]
    total, free, available = (info[n] / GIB_KB for n in ("MemTotal", "MemFree", "MemAvailable"))
    if not is_integrated:
        shared = "no GPU" if is_integrated is None else "the GPU has memory of its own"
        return [
            Check("memory", "pass", f"MemAvailable {available:.1f} of {total:.1f} GiB ({shared})")
        ]
    return [_os_floor(available, total, planned_gib, floor_gib), _page_cache(free, available)]


def _os_floor(available: float, total: float, planned: float, floor: float) -> Check:
    left = available - planned
    measured = f"MemAvailable {available:.1f} of {total:.1f} GiB"
    if planned:
        measured += f", {planned:.1f} GiB planned, {left:.1f} GiB left"
    if left < floor:
        detail = f"{measured}: below the OS floor of {floor:g} GiB (unified memory)"
        return Check("memory.os_floor", "warn", detail, FLOOR_FIX)
    return Check("memory.os_floor", "pass", f"{measured}; the OS floor is {floor:g} GiB")


def _page_cache(free: float, available: float) -> Check:
    cache = available - free
    measured = f"MemFree {free:.1f} GiB, MemAvailable {available:.1f} GiB"
    if cache < LARGE_PAGE_CACHE_GIB:
        return Check("memory.page_cache", "pass", measured)
    detail = (
        f"{measured}: {cache:.1f} GiB of reclaimable page cache; cudaMemGetInfo reports MemFree "
        "on unified memory, the engine sizes from MemAvailable (opt-in knob drop_page_cache "
        "drops the cache before the weights load)"
    )
    return Check("memory.page_cache", "pass", detail)
