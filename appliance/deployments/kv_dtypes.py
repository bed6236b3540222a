"""What each KV-cache dtype gives a deployment (`dgpp deploy plan`, the console's fit preview):
per KV dtype its bytes per token on rank 0, tokens per GiB of KV pool, the longest context one
request may have, and how many sessions of the configured context the memory holds; a dtype the
family cannot take says why instead."""

from __future__ import annotations

from dataclasses import dataclass, replace

from dgpp.engine.errors import ConfigError
from dgpp.engine.planning.device_memory import DeviceMemory
from dgpp.engine.planning.memory_plan import GIB, kv_bytes_per_token, plan_memory, rank_cache_specs
from dgpp.engine.planning.resolved import ResolvedConfig
from dgpp.engine.planning.weight_count import uses_mtp
from dgpp.kernels.kv_quant import KV_DTYPES


@dataclass(frozen=True)
class KvDtypeRow:
    kv_dtype: str
    bytes_per_token: int = 0  # rank 0's, every layer
    tokens_per_gib: int = 0
    largest_context: int = 0  # one request, the rest of the memory for the KV pool
    sessions: int = 0  # requests of the configured context (max_model_len) the memory holds
    refused: str = ""  # why the family (or device) cannot take this dtype

    def to_json(self) -> dict[str, object]:
        return dict(vars(self))


def kv_dtype_rows(
    resolved: ResolvedConfig, memory: DeviceMemory, largest: object
) -> list[KvDtypeRow]:
    """One row per KV dtype; `largest(config) -> int` is the plan's `largest_context` for rank 0
    (passed in: it searches plans, and the caller has its weights counted)."""
    config, model, tp = resolved.engine, resolved.model, resolved.tp_size
    context = config.max_model_len or model.max_position_embeddings
    rows = []
    for kv in KV_DTYPES:
        try:  # the knobs' rules (the device), then the family's caches
            trial = replace(config, kv_cache_dtype=kv)
            specs = rank_cache_specs(model, tp, 0, uses_mtp(config.speculative, model), kv)
        except ConfigError as err:
            rows.append(KvDtypeRow(kv, refused=err.message))
            continue
        per_token = kv_bytes_per_token(trial, specs)
        plan = plan_memory(trial, model, tp, memory, 0)
        room = plan.budget_bytes - (plan.total_bytes - plan.kv_bytes)
        tokens = max(0, room) // per_token if per_token else 0
        per_gib = GIB // per_token if per_token else 0
        rows.append(KvDtypeRow(kv, per_token, per_gib, largest(trial), tokens // context))
    return rows


def describe_kv_dtypes(rows: list[KvDtypeRow], context: int) -> str:
    lines = [
        f"| KV dtype | bytes/token | tokens per GiB | largest context | sessions of {context:,} |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row.refused:
            lines.append(f"| {row.kv_dtype} | refused: {row.refused} | | | |")
            continue
        lines.append(
            f"| {row.kv_dtype} | {row.bytes_per_token:,} | {row.tokens_per_gib:,} | "
            f"{row.largest_context:,} | {row.sessions:,} |"
        )
    return "\n".join(lines)
