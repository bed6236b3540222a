"""The deployment's `side_models:` (issue 67): models served beside the main one, each by an engine
process of its own on one node (single-rank), behind rank 0's HTTP front, which routes a request
to one by its `model` name or an alias. The main model stays the tensor-parallel world.

    side_models:
      - name: fast
        model: /models/Qwen3-1.7B
        aliases: ["claude-3-5-haiku*", "claude-haiku-*"]   # Claude Code's small fast model
        load: always
      - name: embed
        model: /models/Qwen3-Embedding-0.6B
        kind: embed
        idle_unload_s: 300
        engine: {kv_capacity: 8192}
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

from pydantic import Field, model_validator

from dgpp.appliance.deployments.knob_schema import Section, section_model
from dgpp.engine.configuration.engine_config import EngineConfig

SideEngineSection = section_model(
    "SideEngineSection",
    "engine",
    EngineConfig,
    doc="The side model's engine knobs: the same table as the main model's `engine:`.",
)

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"


class SideModel(Section):
    """One side model: what it serves, where, and when it is loaded."""

    name: str = Field(pattern=NAME_PATTERN)
    model: str = Field(min_length=1)  # checkpoint dir, HF repo id, or "default"
    kind: Literal["generate", "embed", "rerank"] = "generate"
    # More names it answers to; a pattern (claude-3-5-haiku*) answers to every match
    aliases: list[str] = Field(default_factory=list, max_length=32)
    node: int = Field(0, ge=0)  # the rank whose node runs it
    # The memory it may take on its node; unset: its engine's own memory plan
    memory_gib: float | None = Field(None, gt=0)
    load: Literal["on_demand", "always"] = "on_demand"
    idle_unload_s: float = Field(600.0, ge=0)  # 0: never unloaded for being idle
    engine: SideEngineSection = Field(default_factory=SideEngineSection)  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _one_kind(self) -> SideModel:
        if self.engine.kind not in ("generate", self.kind):
            raise ValueError(
                f"side model {self.name!r}: engine.kind {self.engine.kind!r} contradicts its "
                f"kind {self.kind!r}; set kind alone"
            )
        return self

    def answers(self, requested: str) -> bool:
        """Whether a request for `requested` is this side model's."""
        return requested == self.name or any(
            requested == alias or fnmatchcase(requested, alias) for alias in self.aliases
        )


def check_side_models(side: list[SideModel], main_names: list[str], world_size: int) -> None:
    """Names and aliases are each one model's, none is the main model's, and every node is a
    rank of the world; `ValueError` says which."""
    seen: dict[str, str] = {name: "the main model" for name in main_names}
    for each in side:
        if each.node >= world_size:
            raise ValueError(
                f"side model {each.name!r}: node {each.node} is not a rank of this world of "
                f"{world_size}"
            )
        for name in (each.name, *each.aliases):
            owner = seen.get(name)
            if owner is not None:
                raise ValueError(f"side model {each.name!r}: {name!r} already names {owner}")
            seen[name] = f"side model {each.name!r}"


def side_model_for(side: list[SideModel], requested: str) -> SideModel | None:
    """The side model a request for `requested` goes to: an exact name or alias first, then the
    first whose alias pattern matches; None: the main model's (or no model's)."""
    for each in side:
        if requested == each.name or requested in each.aliases:
            return each
    return next((each for each in side if each.answers(requested)), None)
