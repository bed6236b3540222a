"""What a deployment will hold in memory on each rank, as a preview shows it before any switch:
the engine's own memory plan (`appliance.deployments.plan`, the plan `dgpp deploy plan` prints)
against the budget rank 0 will size its pool from, with the verdict, the largest context one
request can have, and — when it does not fit — the refusal with its numbers and the knob it
belongs to. Beside it, what each KV-cache dtype (`engine.kv_cache_dtype`) would give rank 0 on the
same memory (`appliance.deployments.kv_dtypes`), so an operator sees what each value buys before
applying one.

The budget is the one the engine reads when it starts (`memory_plan.read_device_memory`): host
RAM available now for `engine.device: cpu` (the engine being replaced still holds its share, so
the preview errs on the safe side); for CUDA the device of this node when NVML can say its size
(taken as free: the engine being replaced releases its own), else a DGX Spark's, as `dgpp deploy
plan` assumes. Every rank is planned against the same memory."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from dgpp.appliance.deployments.deployment import Deployment
from dgpp.appliance.deployments.kv_dtypes import KvDtypeRow, kv_dtype_rows
from dgpp.engine.errors import ConfigError, ModelLoadError, one_line
from dgpp.engine.planning.memory_plan import DeviceMemory, format_bytes

if TYPE_CHECKING:
    from dgpp.appliance.deployments.plan import RankPlan
    from dgpp.engine.configuration.engine_config import EngineConfig
    from dgpp.engine.planning.resolved import ResolvedConfig

log = logging.getLogger(__name__)

Verdict = Literal["fits", "refused", "unknown"]
# The knob a refusal belongs to, by the part of the plan that overflows.
_WORKSPACE_KNOB = "engine.prefill_chunk_tokens"
_STATES_KNOB = "engine.prefix_cache_gib"


@dataclass(frozen=True)
class RankMemory:
    """One rank's plan, in bytes, as the preview's table shows it."""

    rank: int
    weights_bytes: int
    kv_tokens: int
    kv_bytes: int
    kv_bytes_per_token: int
    workspace_bytes: int  # one step's activations plus the fixed buffers (rotary tables, ...)
    state_bytes: int  # recurrent layers' running states and prefix snapshots (hybrid models)
    total_bytes: int
    budget_bytes: int
    largest_context: int  # the longest single request that fits on this rank
    fits: bool
    states: str = "-"  # `describe_states`: slot size x (running + snapshots)

    def text(self, name: str) -> str:
        """A byte count of this row as the table shows it (`weights_bytes` -> "15.26 GiB")."""
        return format_bytes(getattr(self, name))


@dataclass(frozen=True)
class SideMemory:
    """A node with the side models it must hold (`appliance.deployments.side_plan`)."""

    node: int
    main_bytes: int
    always: str  # "fast 16.4 GiB, ..." or "-"
    on_demand: str  # the largest on-demand one, or "-"
    total_bytes: int
    budget_bytes: int
    problems: str  # "" when it fits

    def text(self, name: str) -> str:
        return format_bytes(getattr(self, name))


@dataclass(frozen=True)
class MemoryPreview:
    verdict: Verdict
    message: str  # the refusal with its numbers, or why there is no plan; "" when it fits
    field: str = ""  # the knob a refusal belongs to ("": the model, the world or no one knob)
    model: str = ""
    source: str = ""  # where the model's shapes came from: "checkpoint" or "facts"
    quantization: str = ""
    device: str = ""  # the memory planned against
    ranks: tuple[RankMemory, ...] = ()
    kv_dtype: str = ""  # the deployment's `engine.kv_cache_dtype`
    kv_context: int = 0  # the context a row's `sessions` counts (max_model_len)
    kv_dtypes: tuple[KvDtypeRow, ...] = ()  # rank 0 at each KV dtype, the configured one among them
    sides: tuple[SideMemory, ...] = ()  # each node with its side models (none without any)

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"

    @property
    def largest_context(self) -> int:
        return min((rank.largest_context for rank in self.ranks), default=0)

    @property
    def weights_bytes(self) -> int:
        """Rank 0's weights (it holds the largest share)."""
        return self.ranks[0].weights_bytes if self.ranks else 0

    def summary(self) -> str:
        """One line: the verdict with the largest context, or the message."""
        if self.verdict == "fits":
            kv = self.ranks[0].kv_tokens if self.ranks else 0
            return (
                f"fits on {self.device}: {kv:,} KV tokens per rank; the largest context one "
                f"request can have is {self.largest_context:,} tokens"
            )
        return self.message

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryPreview:
        """The inverse of `asdict` (a plan read back from `plans.cache`'s store)."""
        ranks = tuple(RankMemory(**rank) for rank in data.get("ranks", ()))
        kv_dtypes = tuple(KvDtypeRow(**row) for row in data.get("kv_dtypes", ()))
        sides = tuple(SideMemory(**row) for row in data.get("sides", ()))
        return cls(**{**data, "ranks": ranks, "kv_dtypes": kv_dtypes, "sides": sides})


def gpu_memory(index: int, nvml_loader: Callable[[], Any] | None = None) -> DeviceMemory | None:
    """GPU `index` of this node as NVML sizes it, or None (no NVML, no such GPU, or a board
    whose memory NVML does not report, as a Spark's unified memory)."""
    try:
        if nvml_loader is None:
            import pynvml

            nvml: Any = pynvml
        else:
            nvml = nvml_loader()
        nvml.nvmlInit()
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            name = nvml.nvmlDeviceGetName(handle)
        finally:
            nvml.nvmlShutdown()
    except Exception:  # no package, no driver, NotSupported: the caller falls back
        return None
    if isinstance(name, bytes):
        name = name.decode()
    description = f"cuda:{index} ({name}, {format_bytes(total)}, none of it held by others)"
    return DeviceMemory(total, total, description, is_accelerator=True)


def budget_memory(
    deployment: Deployment, gpu: Callable[[int], DeviceMemory | None] = gpu_memory
) -> DeviceMemory:
    """The memory rank 0 of `deployment` will plan against when it starts."""
    from dgpp.appliance.deployments.plan import spark_memory
    from dgpp.engine.planning.device_memory import read_host_memory

    device = deployment.engine.device
    if not device.startswith("cuda"):
        return read_host_memory()  # what `read_device_memory("cpu")` reads
    index = int(device.partition(":")[2] or 0)
    return gpu(index) or spark_memory()


def preview_memory(deployment: Deployment, memory: DeviceMemory) -> MemoryPreview:
    """The plan of every rank of `deployment`; never raises: what cannot be planned says why."""
    from dgpp.appliance.deployments.plan import model_config_of

    try:
        model, source = model_config_of(deployment)
    except ModelLoadError as err:
        return MemoryPreview(
            "unknown",
            "no memory plan: the checkpoint is not on this machine and no facts about it ship "
            f"with dgpp ({err.message}); the switch is allowed, rank 0 checks when it loads",
            model=deployment.model,
            device=memory.description,
        )
    except Exception as err:  # a config.json this cannot read: rank 0 will say more
        log.exception("reading the model of %s failed", deployment.model)
        return MemoryPreview(
            "unknown",
            f"no memory plan: the model's config cannot be read ({one_line(err)})",
            model=deployment.model,
            device=memory.description,
        )
    base = {
        "model": deployment.model,
        "source": source,
        "quantization": model.quant_method or "none",
        "device": memory.description,
        "kv_dtype": deployment.engine.kv_cache_dtype,
    }
    try:
        ranks, kv = _plan_ranks(deployment, model, memory)
    except (ConfigError, ModelLoadError) as err:
        # rank 0's own refusal: a pool it cannot size, a context longer than the pool, a model
        # it cannot shard over the world, a quantization the checkpoint is not stored in, an
        # architecture it does not know
        field = f"engine.{err.param}" if err.param else _knob_named(err.message)
        return MemoryPreview("refused", err.message, field, **base)
    except Exception as err:  # a planning bug must not take the preview down; say so plainly
        log.exception("the memory plan of %s failed", deployment.model)
        return MemoryPreview("unknown", f"the memory plan failed: {one_line(err)}", **base)
    unfit = [rank for rank in ranks if not rank.fits]
    side_problems = "; ".join(f"node {side.node}: {side.problems}" for side in kv["sides"]
                              if side.problems)  # fmt: skip
    if not unfit and side_problems:
        message = f"the side models do not fit: {side_problems}"
        return MemoryPreview("refused", message, "side_models", **base, ranks=ranks, **kv)
    if not unfit:
        return MemoryPreview("fits", "", **base, ranks=ranks, **kv)
    message, field = _refusal(unfit, memory, deployment)
    return MemoryPreview("refused", message, field, **base, ranks=ranks, **kv)


def kv_dtype_table(
    resolved: ResolvedConfig, memory: DeviceMemory, rank0: RankPlan
) -> tuple[KvDtypeRow, ...]:
    """Rank 0's row at each KV dtype (`dgpp deploy plan`'s table). The configured dtype's
    largest context is the plan's own; each other's is searched with the weights the plan
    counted (a few milliseconds each: counting them is what takes seconds)."""
    from dgpp.appliance.deployments.plan import largest_context

    def longest(trial: EngineConfig) -> int:
        if trial.kv_cache_dtype == resolved.engine.kv_cache_dtype:
            return rank0.largest_context
        weights = rank0.plan.weights_bytes
        return largest_context(trial, resolved.model, resolved.tp_size, 0, memory, weights)

    return tuple(kv_dtype_rows(resolved, memory, longest))


def _knob_named(message: str) -> str:
    """The engine knob an engine message starts with (`max_model_len=32768 exceeds ...`)."""
    from dgpp.appliance.deployments.deployment import EngineSection

    match = re.match(r"([a-z_]+)[=:( ]", message)
    if match is None or match.group(1) not in EngineSection.model_fields:
        return ""
    return f"engine.{match.group(1)}"


def _plan_ranks(
    deployment: Deployment, model: Any, memory: DeviceMemory
) -> tuple[tuple[RankMemory, ...], dict[str, Any]]:
    """Every rank's row, and the KV-dtype fields of the preview (rank 0's rows)."""
    from dgpp.appliance.deployments.plan import describe_states, plan_deployment, resolve_deployment

    resolved = resolve_deployment(deployment, model, memory)
    entries = plan_deployment(resolved, memory)
    rows = []
    for entry in entries:
        plan = entry.plan
        rows.append(
            RankMemory(
                rank=entry.rank,
                weights_bytes=plan.weights_bytes,
                kv_tokens=plan.kv_tokens,
                kv_bytes=plan.kv_bytes,
                kv_bytes_per_token=entry.kv_bytes_per_token,
                workspace_bytes=plan.workspace_bytes + plan.buffers_bytes,
                state_bytes=plan.state_bytes,
                total_bytes=plan.total_bytes,
                budget_bytes=plan.budget_bytes,
                largest_context=entry.largest_context,
                fits=plan.fits,
                states=describe_states(entry.states),
            )
        )
    context = resolved.engine.max_model_len or model.max_position_embeddings
    try:  # a side table: its failure must not take the plan down
        kv_dtypes = kv_dtype_table(resolved, memory, entries[0]) if entries else ()
    except Exception:
        log.exception("the KV dtype rows of %s failed", deployment.model)
        kv_dtypes = ()
    return tuple(rows), {
        "kv_context": context,
        "kv_dtypes": kv_dtypes,
        "sides": side_rows(deployment, entries, memory),
    }


def side_rows(deployment: Deployment, entries: list[RankPlan], memory: DeviceMemory) -> tuple:
    """Each node's row of the side-model plan (empty without side models)."""
    from dgpp.appliance.deployments.side_plan import plan_side_models

    rows = [
        SideMemory(
            node=node.node,
            main_bytes=node.main_bytes,
            always=node.always_text(),
            on_demand=node.on_demand_text(),
            total_bytes=node.total_bytes,
            budget_bytes=node.budget_bytes,
            problems="; ".join(node.problems()),
        )
        for node in plan_side_models(deployment, entries, memory)
    ]
    return tuple(rows)


def _refusal(
    unfit: list[RankMemory], memory: DeviceMemory, deployment: Deployment
) -> tuple[str, str]:
    """The refusal's text (every unfit rank's numbers and what would fit) and its knob: the KV
    pool when the rest fits on its own, else the largest part the knobs size."""
    worst = max(unfit, key=lambda rank: rank.total_bytes - rank.budget_bytes)
    fixed = worst.total_bytes - worst.kv_bytes
    room = worst.budget_bytes - fixed
    if room >= worst.kv_bytes_per_token > 0:
        field = "engine.kv_capacity"
        hint = f"at most about {room // worst.kv_bytes_per_token:,} KV tokens would fit"
    else:  # the largest fixed part; the weights belong to the model and the world, no knob
        sizes = {
            "": worst.weights_bytes,
            _WORKSPACE_KNOB: worst.workspace_bytes,
            _STATES_KNOB: worst.state_bytes,
        }
        field = max(sizes, key=lambda knob: sizes[knob])
        hint = "not even the weights, workspace and states fit without any KV pool"
    parts = "; ".join(
        f"rank {rank.rank}: weights {rank.text('weights_bytes')} + KV {rank.text('kv_bytes')} "
        f"({rank.kv_tokens:,} tokens) + workspace {rank.text('workspace_bytes')}"
        + (f" + states {rank.text('state_bytes')}" if rank.state_bytes else "")
        + f" = {rank.text('total_bytes')} of a {rank.text('budget_bytes')} budget"
        for rank in unfit
    )
    world = deployment.world_size
    message = f"does not fit on {memory.description} (world {world}): {parts}; {hint}" + (
        f"; the largest context one request can have is {worst.largest_context:,} tokens"
        if worst.largest_context
        else ""
    )
    return message, field
