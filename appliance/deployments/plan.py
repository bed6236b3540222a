"""What a deployment will hold on each rank of its world, before anything is downloaded or
started: weights, KV bytes per token, the recurrent states of hybrid models (one slot per running
request plus the prefix cache's snapshots, `engine.planning.state_plan`), the largest context one
request can have, and whether the engine as configured fits (`dgpp deploy plan`,
`docs/models.md`).

The model comes from its checkpoint when it is on this machine, else from the facts shipped for
the templates' models (`appliance.models.facts`). The memory is a DGX Spark's unless told
otherwise: 128 GB of unified memory, 4 GB of it the OS's, and the CUDA rule of
`DeviceMemory.budget` (90% of the device unless `memory_fraction` says otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from dgpp.appliance.deployments.deployment import Deployment, checkpoint_of, engine_config
from dgpp.appliance.models.facts import facts_config, has_facts
from dgpp.engine.backends.state_cache import StateLayout
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.errors import ConfigError, ModelLoadError
from dgpp.engine.planning.memory_plan import (
    DTYPE_BYTES,
    DeviceMemory,
    MemoryPlan,
    format_bytes,
    kv_bytes_per_token,
    plan_memory,
    rank_cache_specs,
    rank_weight_bytes,
    uses_mtp,
)
from dgpp.engine.planning.resolved import ResolvedConfig, resolve
from dgpp.engine.planning.state_plan import engine_state_layout

SPARK_BYTES = 128 * 10**9
SPARK_OS_BYTES = 4 * 10**9


def spark_memory(total_bytes: int = SPARK_BYTES) -> DeviceMemory:
    return DeviceMemory(
        total_bytes,
        total_bytes - SPARK_OS_BYTES,
        f"DGX Spark ({total_bytes / 1e9:.0f} GB unified)",
        is_accelerator=True,
    )


NO_STATES = StateLayout(0, 0, 0)


@dataclass(frozen=True)
class RankPlan:
    rank: int
    plan: MemoryPlan  # the deployment's engine settings as they are
    kv_bytes_per_token: int
    largest_context: int  # longest single request that fits (0: not even one block)
    # Recurrent layers' slots as configured (counted in plan.state_bytes); empty without any.
    states: StateLayout = NO_STATES


def model_config_of(deployment: Deployment) -> tuple[ModelConfig, str]:
    """The deployment's model and where its facts came from (`checkpoint` or `facts`)."""
    try:
        return ModelConfig.from_checkpoint(checkpoint_of(deployment)), "checkpoint"
    except ModelLoadError:
        if not has_facts(deployment.model):
            raise
    return facts_config(deployment.model), "facts"


def largest_context(
    config: EngineConfig,
    model: ModelConfig,
    tp_size: int,
    rank: int,
    memory: DeviceMemory,
    weights: int | None = None,
) -> int:
    """The longest context (whole blocks, at most the model's position limit) for which one
    request's KV pool, the weights, buffers and one step's workspace fit, with one request's
    recurrent state and the snapshots `prefix_cache_gib` holds (hybrid models)."""
    block = config.block_size
    if weights is None:  # rank `rank`'s `rank_weight_bytes`, when the caller has not counted it
        mtp = uses_mtp(config.speculative, model)
        weights = rank_weight_bytes(model, tp_size, rank, DTYPE_BYTES[config.resolved_dtype], mtp)

    def fits(tokens: int) -> bool:
        trial = replace(config, kv_capacity=tokens, max_model_len=tokens, max_concurrency=1)
        return plan_memory(trial, model, tp_size, memory, rank, weights).fits

    low, high = 0, model.max_position_embeddings // block
    while low < high:  # the largest block count that fits
        mid = (low + high + 1) // 2
        if fits(mid * block):
            low = mid
        else:
            high = mid - 1
    return low * block


def resolve_deployment(
    deployment: Deployment, model: ModelConfig, memory: DeviceMemory | None = None
) -> ResolvedConfig:
    """The configuration the ranks of `deployment` would run on `memory` (a Spark's unless
    told): the same `resolve` step rank 0 takes, so it refuses what rank 0 would (a quantization
    the checkpoint is not stored in, an unknown architecture, a pool `memory_fraction` cannot
    size, a context longer than the pool) with rank 0's words."""
    memory = memory or spark_memory()
    try:
        checkpoint = checkpoint_of(deployment)
    except ModelLoadError:  # planned from the facts shipped for it: not on this machine yet
        checkpoint = Path(deployment.model)
    return resolve(engine_config(deployment), checkpoint, deployment.world_size, model, memory)


def plan_deployment(resolved: ResolvedConfig, memory: DeviceMemory | None = None) -> list[RankPlan]:
    """Every rank's memory plan of `resolved` on `memory` (a Spark's unless told)."""
    memory = memory or spark_memory()
    config, model, tp_size = resolved.engine, resolved.model, resolved.tp_size
    plans = []
    for rank in range(tp_size):
        mtp = uses_mtp(config.speculative, model)
        specs = rank_cache_specs(model, tp_size, rank, mtp, config.kv_cache_dtype)
        # Counted once per rank: building a large MoE on the meta device takes seconds.
        dtype_bytes = DTYPE_BYTES[config.resolved_dtype]
        weights = rank_weight_bytes(model, tp_size, rank, dtype_bytes, mtp)
        plan = plan_memory(config, model, tp_size, memory, rank, weights)
        longest = largest_context(config, model, tp_size, rank, memory, weights)
        states = engine_state_layout(config, model, tp_size, rank)  # plan.state_bytes' slots
        per_token = kv_bytes_per_token(config, specs)
        plans.append(RankPlan(rank, plan, per_token, longest, states))
    return plans


def describe_states(states: StateLayout) -> str:
    """`75.4 MiB x (16 running + 54 snapshots) = 5.15 GiB` (`+ 48 drafts` with speculative
    decoding); `-` without recurrent layers."""
    if not states.slot_bytes:
        return "-"
    drafts = f" + {states.num_draft_slots} drafts" if states.num_draft_slots else ""
    return (
        f"{format_bytes(states.slot_bytes)} x ({states.num_running} running + "
        f"{states.num_snapshots} snapshots{drafts}) = {format_bytes(states.total_bytes)}"
    )


def describe_plans(plans: list[RankPlan]) -> str:
    header = "| rank | weights | KV bytes/token | largest context | as configured |"
    hybrid = any(entry.states.slot_bytes for entry in plans)
    if hybrid:  # only models with recurrent layers have states to show
        header = (
            "| rank | weights | KV bytes/token | states + snapshots | largest context "
            "| as configured |"
        )
    lines = [header, "|---" * header.count(" | ") + "|---|"]
    for entry in plans:
        plan = entry.plan
        verdict = "fits" if plan.fits else f"does not fit ({format_bytes(plan.total_bytes)} needed)"
        states = f" | {describe_states(entry.states)}" if hybrid else ""
        lines.append(
            f"| {entry.rank} | {format_bytes(plan.weights_bytes)} | {entry.kv_bytes_per_token:,}"
            f"{states} | {entry.largest_context:,} | {plan.kv_tokens:,} KV tokens: {verdict} of "
            f"{format_bytes(plan.budget_bytes)} |"
        )
    return "\n".join(lines)


def refuse_unfit(plans: list[RankPlan]) -> None:
    """`ConfigError` naming the ranks whose plan does not fit and their numbers."""
    unfit = [entry for entry in plans if not entry.plan.fits]
    if unfit:
        details = "; ".join(f"rank {entry.rank}: {entry.plan.describe()}" for entry in unfit)
        raise ConfigError(f"this deployment does not fit: {details}")
