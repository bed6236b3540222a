"""Rank 0's memory, as `/v1/metrics` and `/metrics` report it: the process's resident host memory
and, when the process runs on CUDA, the device memory it holds. Read at every call: these are
readings of the process itself (like psutil's), not state the engine keeps."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch


@dataclass(frozen=True)
class MemoryReading:
    """Bytes. The device fields are None when the process has not initialised CUDA (CPU)."""

    host_rss_bytes: int  # resident set of this process (host RAM; on unified memory, shared)
    device_allocated_bytes: int | None  # held by live tensors (`torch.cuda.memory_allocated`)
    device_reserved_bytes: int | None  # held by the caching allocator, >= allocated
    device_total_bytes: int | None  # the devices' memory (`torch.cuda.mem_get_info`)


def read_memory() -> MemoryReading:
    """The reading now. Device figures sum over the CUDA devices this process holds memory on
    (one per rank); a device it never allocated on is not touched, so no context is created
    there, and a process that holds nothing on any device has no device reading."""
    rss = int(psutil.Process().memory_info().rss)
    if not torch.cuda.is_initialized():
        return MemoryReading(rss, None, None, None)
    used = [i for i in range(torch.cuda.device_count()) if torch.cuda.memory_reserved(i) > 0]
    if not used:
        return MemoryReading(rss, None, None, None)
    return MemoryReading(
        rss,
        sum(int(torch.cuda.memory_allocated(i)) for i in used),
        sum(int(torch.cuda.memory_reserved(i)) for i in used),
        sum(int(torch.cuda.mem_get_info(i)[1]) for i in used),
    )
