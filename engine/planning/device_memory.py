"""What a rank's memory plan draws from: one reading of a CUDA device's memory, or of host RAM
for CPU ranks (`engine.planning.memory_plan`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

# Without `memory_fraction`, a CUDA rank leaves a tenth of the device for the CUDA context, cuBLAS
# and NCCL buffers and allocator fragmentation, none of which the plan counts.
DEFAULT_CUDA_FRACTION = 0.9


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of the memory a rank draws from: a CUDA device, or host RAM for CPU ranks."""

    total_bytes: int
    free_bytes: int
    description: str
    is_accelerator: bool
    reserve_bytes: int = 0  # what a GPU sharing the host's memory leaves the OS at least

    def budget(self, fraction: float | None) -> int:
        """Bytes this rank may plan to use.

        CUDA: `total * (fraction or 0.9)` minus what others already hold (`total - free`), and
        on unified memory no more than leaves the OS its floor (`reserve_bytes`) of what is
        available. CPU: the available memory, capped at `total * fraction` when a fraction is
        set."""
        if self.is_accelerator:
            share = DEFAULT_CUDA_FRACTION if fraction is None else fraction
            budget = int(self.total_bytes * share) - (self.total_bytes - self.free_bytes)
            if self.reserve_bytes:
                budget = min(budget, self.free_bytes - self.reserve_bytes)
        elif fraction is None:
            budget = self.free_bytes
        else:
            budget = min(self.free_bytes, int(self.total_bytes * fraction))
        return max(0, budget)


def read_host_memory(meminfo: Path = Path("/proc/meminfo")) -> DeviceMemory:
    """Host RAM from `/proc/meminfo` (MemTotal, MemAvailable); sysconf where there is none."""
    if meminfo.is_file():
        fields = {}
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
        total = fields["MemTotal"]
        free = fields.get("MemAvailable", fields.get("MemFree", total))
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        free = (
            os.sysconf("SC_AVPHYS_PAGES") * page if "SC_AVPHYS_PAGES" in os.sysconf_names else total
        )
    return DeviceMemory(total, free, "cpu (host RAM)", is_accelerator=False)


def read_device_memory(device: str, os_floor_bytes: int = 0) -> DeviceMemory:
    """The current reading for `device` ('cpu', 'cuda' or 'cuda:N').

    A GPU that shares the host's memory (`is_integrated`: DGX Spark's GB10) reads it from
    `/proc/meminfo`: `cudaMemGetInfo` there reports MemFree, so reclaimable page cache (the
    checkpoint just read) would count as taken. Its plan leaves the OS `os_floor_bytes`: an
    out-of-memory on unified memory can hang the machine instead of failing."""
    if not device.startswith("cuda"):
        return read_host_memory()
    index = torch.device(device)
    name = torch.cuda.get_device_name(index)
    if getattr(torch.cuda.get_device_properties(index), "is_integrated", False):
        host = read_host_memory()
        floor = os_floor_bytes / 2**30
        where = f"{device} ({name}, unified memory: MemAvailable, OS floor {floor:g} GiB)"
        return DeviceMemory(host.total_bytes, host.free_bytes, where, True, os_floor_bytes)
    free, total = torch.cuda.mem_get_info(index)
    return DeviceMemory(total, free, f"{device} ({name})", is_accelerator=True)


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache(control: Path = DROP_CACHES) -> str:
    """Drop the kernel's clean page cache (`drop_page_cache`: the plan then reads the memory
    it frees as free); what happened, in words. Needs root; never raises."""
    os.sync()
    try:
        control.write_text("1\n")
    except OSError as err:
        return f"could not drop the page cache ({control}: {err.strerror or err}); run as root"
    return "dropped the page cache"
