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

    def budget(self, fraction: float | None) -> int:
        """Bytes this rank may plan to use.

        CUDA: `total * (fraction or 0.9)` minus what others already hold (`total - free`).
        CPU: the available memory, capped at `total * fraction` when a fraction is set."""
        if self.is_accelerator:
            share = DEFAULT_CUDA_FRACTION if fraction is None else fraction
            budget = int(self.total_bytes * share) - (self.total_bytes - self.free_bytes)
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


def read_device_memory(device: str) -> DeviceMemory:
    """The current reading for `device` ('cpu', 'cuda' or 'cuda:N')."""
    if not device.startswith("cuda"):
        return read_host_memory()
    index = torch.device(device)
    free, total = torch.cuda.mem_get_info(index)
    name = torch.cuda.get_device_name(index)
    return DeviceMemory(total, free, f"{device} ({name})", is_accelerator=True)
