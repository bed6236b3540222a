"""How many recurrent-state slots an engine allocates, and what they cost: one per request it
may serve at once (`max_concurrency`) plus the prefix cache's snapshots, as many as
`prefix_cache_gib` holds (none with the prefix cache off), never more than the KV pool has
blocks (a snapshot is found only through a cached block), and with speculative decoding
`spec_depth` draft slots per request (the states of a verify row's positions)."""

from __future__ import annotations

from dgpp.engine.backends.state_cache import StateLayout, state_layout
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.models.registry import layer_state_specs

GIB = 1 << 30


def snapshot_budget_bytes(config: EngineConfig) -> int:
    return int(config.prefix_cache_gib * GIB) if config.prefix_cache else 0


def engine_state_layout(
    config: EngineConfig,
    model: ModelConfig,
    tp_size: int,
    tp_rank: int = 0,
    max_snapshots: int | None = None,
) -> StateLayout:
    """Rank `tp_rank`'s slots; `max_snapshots` defaults to the KV pool's block count."""
    parallel = ParallelContext(tp_rank=tp_rank, tp_size=tp_size)
    specs = layer_state_specs(model, parallel, config.kv_cache_dtype)
    cap = config.num_kv_blocks if max_snapshots is None else max_snapshots
    depth = config.spec_depth if config.speculative != "off" else 0
    return state_layout(specs, config.max_concurrency, snapshot_budget_bytes(config), cap, depth)
