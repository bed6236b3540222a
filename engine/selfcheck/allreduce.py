"""All-reduce bandwidth between a world's ranks, measured once at every world's warm-up (all
ranks at the same point), so `dgpp doctor` and the console can set it beside the link's rate.

Bus bandwidth as NCCL's tests report it: a ring all-reduce of S bytes over n ranks moves
2 (n - 1) / n * S bytes through each rank's link, so bus = that / seconds, in Gbit/s."""

from __future__ import annotations

import time

import torch

from dgpp.engine.configuration.parallel import ParallelContext

# Message sizes: NCCL over RDMA reaches its rate from tens of MiB; gloo over TCP on CPUs is
# slower, so its sizes stay small enough to keep a start quick.
CUDA_SIZES = (1 << 20, 16 << 20, 64 << 20)
CPU_SIZES = (64 << 10, 1 << 20, 4 << 20)
REPEATS = 5


def measure_allreduce(parallel: ParallelContext, device: torch.device) -> list[dict[str, float]]:
    """[{bytes, seconds (one all-reduce, the mean of a few), bus_gbps}] per size; [] for a
    world of one."""
    if parallel.tp_size < 2:
        return []
    ranks = parallel.tp_size
    found = []
    for size in CUDA_SIZES if device.type == "cuda" else CPU_SIZES:
        buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
        parallel.all_reduce(buffer)  # warm-up: connections and buffers set up
        _sync(device)
        started = time.perf_counter()
        for _ in range(REPEATS):
            parallel.all_reduce(buffer)
        _sync(device)
        seconds = (time.perf_counter() - started) / REPEATS
        moved = 2 * (ranks - 1) / ranks * size
        found.append({"bytes": size, "seconds": seconds, "bus_gbps": moved * 8 / seconds / 1e9})
        del buffer
    return found


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
