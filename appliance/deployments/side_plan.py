"""The side models in a deployment's memory plan (issue 67): on each node, the main model's rank
there, every `always` side model placed there, and the largest on-demand one (the others are
unloaded to make room for it) must fit the node's memory, and `side_memory_gib` (where set) must
hold the `always` ones with the largest on-demand one. `dgpp deploy plan` prints it and refuses
a deployment that cannot hold them, naming what does not fit; the console's fit preview shows it.

A side model takes its `memory_gib`, else its engine's own memory plan on one rank (from its
checkpoint, or the facts shipped for the templates' models).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dgpp.appliance.deployments.deployment import Deployment, checkpoint_of, parse_deployment
from dgpp.appliance.deployments.knob_schema import key_of, section_knobs
from dgpp.appliance.deployments.plan import RankPlan, model_config_of
from dgpp.appliance.deployments.side_models import SideModel
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.errors import ConfigError, DgppError
from dgpp.engine.planning.memory_plan import DeviceMemory, format_bytes, plan_memory
from dgpp.engine.planning.resolved import resolve

GIB = 1 << 30


@dataclass(frozen=True)
class SideCost:
    side: SideModel
    bytes: int | None  # None: neither memory_gib nor a plan (its checkpoint is not here)
    source: str  # "memory_gib", "plan" or why there is none

    def text(self) -> str:
        """`emb 2.00 GiB` (`?` where no memory is known)."""
        return f"{self.side.name} {format_bytes(self.bytes) if self.bytes is not None else '?'}"


@dataclass(frozen=True)
class NodePlan:
    node: int
    main_bytes: int
    always: tuple[SideCost, ...]
    on_demand: SideCost | None  # the largest
    budget_bytes: int
    side_budget_bytes: int | None  # side_memory_gib

    @property
    def side_bytes(self) -> int:
        costs = [*self.always, *([self.on_demand] if self.on_demand else [])]
        return sum(cost.bytes or 0 for cost in costs)

    @property
    def total_bytes(self) -> int:
        return self.main_bytes + self.side_bytes

    def problems(self) -> list[str]:
        found = []
        unknown = [c.side.name for c in (*self.always, self.on_demand) if c and c.bytes is None]
        if unknown:
            found.append(f"no memory known for {', '.join(unknown)}: set memory_gib")
        if self.total_bytes > self.budget_bytes:
            found.append(
                f"the main model ({format_bytes(self.main_bytes)}) and {self._names()} "
                f"({format_bytes(self.side_bytes)}) need {format_bytes(self.total_bytes)} of "
                f"{format_bytes(self.budget_bytes)}"
            )
        if self.side_budget_bytes is not None and self.side_bytes > self.side_budget_bytes:
            found.append(
                f"{self._names()} need {format_bytes(self.side_bytes)}, side_memory_gib holds "
                f"{format_bytes(self.side_budget_bytes)}"
            )
        return found

    def always_text(self) -> str:
        """`fast 16.4 GiB, ...`, or `-`."""
        return ", ".join(cost.text() for cost in self.always) or "-"

    def on_demand_text(self) -> str:
        return self.on_demand.text() if self.on_demand is not None else "-"

    def _names(self) -> str:
        names = [cost.side.name for cost in self.always]
        if self.on_demand is not None:
            names.append(f"{self.on_demand.side.name} (largest on demand)")
        return "side models " + ", ".join(names)


def side_engine_config(side: SideModel) -> EngineConfig:
    """The side model's engine knobs as its own server runs them (its `engine:` section, its
    `kind`)."""
    knobs = {
        each.name: getattr(side.engine, key_of(each))
        for each in section_knobs("engine", EngineConfig)
        if key_of(each) in side.engine.model_fields_set
    }
    return EngineConfig(model=side.model, **{**knobs, "kind": side.kind})


def side_cost(
    side: SideModel, models_dir: str | None, memory: DeviceMemory | None = None
) -> SideCost:
    """What the side model takes: `memory_gib`, else its engine's plan on one rank against
    `memory` (None: this machine's device, as its server will read it)."""
    if side.memory_gib is not None:
        return SideCost(side, int(side.memory_gib * GIB), "memory_gib")
    try:
        checkpoint, model = _model_of(side.model, models_dir)
        resolved = resolve(side_engine_config(side), checkpoint, 1, model, memory)
    except (DgppError, OSError, ValueError) as err:
        return SideCost(side, None, str(err))
    return SideCost(
        side, plan_memory(resolved.engine, resolved.model, 1, memory).total_bytes, "plan"
    )


def _model_of(reference: str, models_dir: str | None) -> tuple[Path, ModelConfig]:
    """The side model's checkpoint and config (the facts shipped for it where it is not here)."""
    probe = parse_deployment({"model": reference, "paths": {"models_dir": models_dir}})
    model, source = model_config_of(probe)
    return (checkpoint_of(probe) if source == "checkpoint" else Path(reference)), model


def plan_side_models(
    deployment: Deployment, plans: list[RankPlan], memory: DeviceMemory
) -> list[NodePlan]:
    """Each node's plan with its side models (none: no side models)."""
    if not deployment.side_models:
        return []
    costs = [
        side_cost(side, deployment.paths.models_dir, memory) for side in deployment.side_models
    ]
    limit = deployment.side_memory_gib
    nodes = []
    for entry in plans:
        here = [cost for cost in costs if cost.side.node == entry.rank]
        always = tuple(cost for cost in here if cost.side.load == "always")
        demand = [cost for cost in here if cost.side.load == "on_demand"]
        largest = max(demand, key=lambda cost: cost.bytes or 0, default=None)
        nodes.append(
            NodePlan(
                entry.rank,
                entry.plan.total_bytes,
                always,
                largest,
                entry.plan.budget_bytes,
                None if limit is None else int(limit * GIB),
            )
        )
    return nodes


def describe_side_plans(nodes: list[NodePlan]) -> str:
    lines = [
        "| node | main model | always | largest on demand | total | fits |",
        "|---|---|---|---|---|---|",
    ]
    for node in nodes:
        problems = node.problems()
        verdict = "yes" if not problems else "no: " + "; ".join(problems)
        lines.append(
            f"| {node.node} | {format_bytes(node.main_bytes)} | {node.always_text()} | "
            f"{node.on_demand_text()} | "
            f"{format_bytes(node.total_bytes)} of {format_bytes(node.budget_bytes)} | {verdict} |"
        )
    return "\n".join(lines)


def refuse_unfit_sides(nodes: list[NodePlan]) -> None:
    unfit = [(node.node, problem) for node in nodes for problem in node.problems()]
    if unfit:
        details = "; ".join(f"node {node}: {problem}" for node, problem in unfit)
        raise ConfigError(f"the side models do not fit: {details}")
