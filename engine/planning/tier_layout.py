"""Where the prefix cache's disk tier keeps its files and what keeps them valid.

A block file is usable only by a process whose KV for the same tokens has the same bytes: the
same checkpoint files and config (as the resident images key them), dtype, KV-cache dtype and
prefill precision, cache pools (shapes, dtypes, the MTP layer's), block size, tensor-parallel
world and rank, and the Python version (block keys are Python hashes of tuples). The layout
digest covers all of it except the rank, which names the folder below it, so the ranks of one
world on one node share a layout and another model's or world's files are foreign to it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from dgpp.engine.cache.disk_store import DiskStore
from dgpp.engine.cache.tier_file import MAGIC
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.planning.host_store import STATE_SHARE, HostStore
from dgpp.engine.planning.memory_plan import GIB
from dgpp.engine.planning.resident_cache import image_key
from dgpp.kernels.cache_dir import dgpp_cache_dir


def prefix_cache_root(config: EngineConfig) -> Path:
    """`prefix_cache_dir`, else $DGPP_PREFIX_CACHE_DIR, else ~/.cache/dgpp/prefix (the node's)."""
    configured = config.prefix_cache_dir or os.environ.get("DGPP_PREFIX_CACHE_DIR")
    if configured:
        return Path(os.path.expandvars(configured)).expanduser()
    return dgpp_cache_dir() / "prefix"


def layout_digest(
    config: EngineConfig,
    model: ModelConfig,
    checkpoint: Path,
    tp_size: int,
    device_type: str,
    pools: Sequence[tuple[torch.Tensor, int]],
) -> str:
    weights = image_key(
        checkpoint, 0, tp_size, config.resolved_dtype, device_type, model.architecture
    )
    shapes = [
        (tuple(pool.shape[:axis]) + tuple(pool.shape[axis + 1 :]), str(pool.dtype), axis)
        for pool, axis in pools
    ]
    parts = (
        MAGIC.decode(),
        f"python {sys.version_info.major}.{sys.version_info.minor}",
        weights.digest,
        config.prefill_precision,
        f"block {config.block_size}",
        repr(shapes),
    )
    if config.kv_cache_dtype != "auto":  # int8 and fp8 rows have one shape, not the same bytes
        parts += (f"kv {config.kv_cache_dtype}",)
    if config.kv_cache_dtype == "int4":  # rows of rotated keys and values (`kv_rotation`)
        parts += ("hadamard 64",)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def open_disk_stores(
    config: EngineConfig,
    model: ModelConfig,
    checkpoint: Path,
    tp_rank: int,
    tp_size: int,
    host: HostStore,
) -> tuple[DiskStore, DiskStore | None] | None:
    """This rank's disk tier (`prefix_cache_disk_gib`), staging its reads in `host`: the
    blocks' store, and a hybrid model's snapshots' (which gets `STATE_SHARE` of the budget and
    shares the blocks' reads in flight); None when off."""
    if config.prefix_cache_disk_gib <= 0:
        return None
    states = host.states
    pools = host.pools + (states.pools if states is not None else [])
    device_type = pools[0][0].device.type
    digest = layout_digest(config, model, checkpoint, tp_size, device_type, pools)
    root = prefix_cache_root(config)
    budget, share = disk_budgets(config, states is not None)
    blocks = DiskStore(root, digest, host.pools, host.hosts, budget, tp_rank)
    if states is None:
        return blocks, None
    snapshots = DiskStore(
        root, digest, states.pools, states.hosts, share, tp_rank, "states", blocks.fetches
    )
    return blocks, snapshots


def disk_budgets(config: EngineConfig, hybrid: bool) -> tuple[int, int]:
    """Bytes of the disk tier's blocks and (hybrid models) snapshots, per rank."""
    budget = int(config.prefix_cache_disk_gib * GIB)
    share = int(budget * STATE_SHARE) if hybrid else 0
    return budget - share, share


def disk_blocks(budget: int, file_bytes: int) -> int:
    """Files rank 0's index holds: `budget` over rank 0's bytes per file (the largest)."""
    return budget // max(file_bytes, 1)
