"""Rank 0's side of the prefix cache's tiers, from what this rank's runner opened: the host
tier's index (and a hybrid model's snapshots' beside it), the disk tier's from the files
already on disk, and their counters for the engine's stats."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dgpp.engine.cache.disk_store import DiskStore
from dgpp.engine.cache.disk_tier import DiskTier, Fetch
from dgpp.engine.cache.host_tier import STATES, HostTier
from dgpp.engine.cache.tier_file import file_bytes
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.planning.tier_layout import disk_blocks, disk_budgets
from dgpp.engine.scheduling.stats import PrefixCacheCounters

if TYPE_CHECKING:
    from dgpp.engine.cache.block_manager import BlockManager
    from dgpp.engine.execution.model_runner import ModelRunner

StateTiers = tuple[HostTier, DiskTier | None]
log = logging.getLogger(__name__)


def rank0_tiers(
    runner: ModelRunner, config: EngineConfig
) -> tuple[HostTier | None, DiskTier | None, StateTiers | None]:
    """(host tier, disk tier, the snapshots' host and disk tiers) as the runner opened them;
    None for each one off. Their ops go to one ordered list, their fetches to another."""
    if not runner.host_slots or runner.host is None:
        return None, None, None
    host = HostTier(runner.host_slots)
    state_host = None
    if runner.state_host_slots:
        state_host = HostTier(runner.state_host_slots, STATES, host.copies)
    disk = state_disk = None
    if runner.disk is not None:
        warn_short_host_tier(runner.host_slots * config.block_size, runner.max_model_len)
        blocks, snapshots = disk_budgets(config, state_host is not None)
        disk = _index(host, runner.disk, blocks, config.block_size)
        states = runner.host.states
        if state_host is not None and states is not None and states.disk is not None:
            state_disk = _index(state_host, states.disk, snapshots, 0, disk.fetching)
    return host, disk, (state_host, state_disk) if state_host is not None else None


def warn_short_host_tier(host_tokens: int, max_model_len: int | None) -> bool:
    """Disk reads stage through host-tier slots, so a host tier that holds less than a long
    prompt caps what the disk tier can give back (measured: 34% of a prompt's blocks back after
    a restart with a 0.02 GiB host tier, at least 80% with 0.1 GiB): say so at start."""
    if max_model_len is None or host_tokens >= max_model_len:
        return False
    log.warning(
        "the prefix cache's host tier holds %d tokens, less than the context limit (%d): the "
        "disk tier can give a longer prompt back only that much at a time, so restarts and "
        "returning sessions recompute the rest; raise engine.prefix_cache_host_gib",
        host_tokens,
        max_model_len,
    )
    return True


def _index(
    host: HostTier,
    store: DiskStore,
    budget: int,
    num_tokens: int,
    fetching: list[Fetch] | None = None,
) -> DiskTier:
    """Rank 0's index of `store`'s files (their headers read back), wired to the store."""
    size = file_bytes(store.payload_bytes, num_tokens)
    disk = DiskTier(host, disk_blocks(budget, size), store.headers(), fetching)
    store.meta, store.unsaved = disk.meta, disk.unsaved.append
    return disk


def report_tiers(cache: PrefixCacheCounters, manager: BlockManager, runner: ModelRunner) -> None:
    """The tiers' counters into the engine's stats (`cache`, a copy)."""
    if (host := manager.host) is not None:
        cache.host_spilled_blocks = host.counters.spilled_blocks
        cache.host_loaded_blocks = host.counters.loaded_blocks
        cache.host_evicted_blocks = host.counters.evicted_blocks
    snapshots = manager.snapshot_tiers
    tiers = [manager.disk, snapshots.disk if snapshots is not None else None]
    stores = [runner.disk, runner.host.states.disk if runner.host and runner.host.states else None]
    for disk in tiers:  # a hybrid model's snapshot files count as blocks
        if disk is not None:
            counters = disk.counters
            cache.disk_blocks += len(disk)
            cache.disk_saved_blocks += counters.saved_blocks
            cache.disk_unsaved_blocks += counters.unsaved_blocks
            cache.disk_fetched_blocks += counters.fetched_blocks
            cache.disk_failed_blocks += counters.failed_blocks
            cache.disk_dropped_blocks += counters.dropped_blocks
    for store in stores:
        if store is not None:
            cache.disk_read_bytes += store.read_bytes
            cache.disk_read_seconds += store.read_seconds
