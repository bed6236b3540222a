"""Rank 0's side of the world: form a generation, push the configuration, load (once) and warm up.

The engine, with its weights and KV pool, is built once and kept across generations; a re-formed
world only gets a new control channel and an empty request table.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from dgpp.engine.distributed.cluster_secret import SecretMismatch, authenticate_world
from dgpp.engine.distributed.control import ControlChannel
from dgpp.engine.distributed.handshake import WorldConfig, push_config, report_loaded
from dgpp.engine.distributed.worker import pushed_config
from dgpp.engine.distributed.world import Rendezvous, World
from dgpp.engine.distributed.world_spec import WorldSpec
from dgpp.engine.engine import LLMEngine
from dgpp.engine.errors import ConfigError, DgppError, ModelLoadError
from dgpp.engine.planning.resolved import ResolvedConfig

log = logging.getLogger(__name__)


@dataclass
class Phases:
    """Seconds spent in each phase of the last time-to-ready."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, started: float) -> float:
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - started
        return now

    def describe(self) -> str:
        total = sum(self.seconds.values())
        parts = ", ".join(f"{name} {value:.2f} s" for name, value in self.seconds.items())
        return f"{total:.2f} s ({parts})"


class FormationError(RuntimeError):
    """This generation cannot start because of another rank; a later one may."""


class Head:
    """Rank 0's world: `form()` once per generation, `dissolve()` when it breaks or stops."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        spec: WorldSpec,
        deployment_id: str | None = None,
        resident_dir: Path | None = None,
    ) -> None:
        """`resident_dir`: this node's resident weight images (see `ModelRunner`)."""
        assert spec.rank == 0 and spec.world_size is not None
        self.spec = spec
        assert resolved.tp_size == spec.world_size, "resolved for another world size"
        self.resolved = resolved  # every rank runs `resolved.engine`, sized once here
        self.config = resolved.engine
        self.checkpoint = resolved.checkpoint
        self.deployment_id = deployment_id
        self.resident_dir = resident_dir
        self.world_size = spec.world_size
        self.engine: LLMEngine | None = None
        self.world: World | None = None
        self.phases = Phases()
        self._rendezvous: Rendezvous | None = None

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        return self._rendezvous.missing if self._rendezvous is not None else ()

    def form(self) -> LLMEngine:
        """Form the next generation and return the engine serving it. Raises `DgppError` when
        rank 0 itself cannot run the configuration; `FormationError` when another rank refuses
        it or cannot load, or the collective's error when a rank is lost meanwhile (the caller
        dissolves and retries those)."""
        self.phases = Phases()
        started = time.monotonic()
        if self.world_size == 1:
            if self.engine is None:
                self.engine = LLMEngine(self.resolved, resident_dir=self.resident_dir)
                started = self._loaded(started, built=True)
                self.engine.warm_up()
                self.phases.add("warm-up", started)
            return self.engine
        if self._rendezvous is None:
            self._rendezvous = Rendezvous(self.spec)
        world = self._rendezvous.form()
        self.world = world
        started = self.phases.add("rendezvous", started)
        try:
            authenticate_world(self.spec.secret, world.generation, 0, world.control_group)
        except SecretMismatch as err:  # a process that took a seat without the secret
            raise FormationError(str(err)) from None
        try:
            push_config(
                WorldConfig.of(pushed_config(self.resolved, self.deployment_id)),
                world.control_group,
            )
        except ConfigError as err:  # a worker refused: it (or its deployment) may be fixed
            raise FormationError(str(err)) from None
        control = ControlChannel(0, world.control_group)
        error = None
        built = self.engine is None
        if built:
            try:
                self.engine = LLMEngine(self.resolved, world.parallel, control, self.resident_dir)
            except DgppError as err:
                error = f"{type(err).__name__}: {err}"
        else:
            self.engine.rejoin(control)
        failures = report_loaded(error, world.control_group, self.spec.timeouts.load_s)
        if error is not None:
            raise ModelLoadError(error)  # rank 0 itself cannot load: no retry will help
        if failures:
            raise FormationError("; ".join(failures))
        assert self.engine is not None
        started = self._loaded(started, built)
        self.engine.warm_up()
        self.phases.add("warm-up", started)
        return self.engine

    def _loaded(self, started: float, built: bool) -> float:
        """Account the load; when rank 0 built its engine just now, the KV pool's reservation
        apart from the rest (weights, tokenizer, and in a world waiting for the slowest rank)."""
        now = self.phases.add("weights", started)
        if built and self.engine is not None:
            kv_seconds = self.engine.runner.kv_seconds
            self.phases.seconds["weights"] -= kv_seconds
            self.phases.seconds["kv"] = kv_seconds
        return now

    def dissolve(self, orderly: bool) -> None:
        """Leave the current generation. `orderly`: the workers are told, and wait for the next
        head; otherwise (a failure) the groups are dropped without waiting for anyone."""
        if self.engine is not None and orderly and self.world is not None:
            try:
                self.engine.shutdown()
            except Exception as err:  # a worker is already gone: nothing more to tell
                log.info("could not tell every worker we are leaving: %s", err)
        if self.engine is not None:
            self.engine.control = None
        if self.world is not None:
            self.world.dissolve()
            self.world = None
