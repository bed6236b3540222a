"""A worker rank (rank > 0): join rank 0's world, load what it pushes, execute its steps; when the
world breaks, join the next one, keeping the loaded weights while the configuration is unchanged."""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.distributed.cluster_secret import authenticate_world
from dgpp.engine.distributed.control import ControlChannel, serve_commands
from dgpp.engine.distributed.handshake import receive_config, report_loaded
from dgpp.engine.distributed.world import World, join_world
from dgpp.engine.distributed.world_spec import WorldSpec
from dgpp.engine.errors import ConfigError, DgppError, one_line
from dgpp.engine.execution.model_runner import ModelRunner
from dgpp.engine.planning.resolved import ResolvedConfig
from dgpp.engine.speculative.mtp_runner import drafter_for

log = logging.getLogger(__name__)


def pushed_config(resolved: ResolvedConfig, deployment_id: str | None = None) -> dict[str, Any]:
    """The configuration rank 0 resolved, pushed as plain data: every rank builds the same runner
    from it (the engine configuration with its KV pool sized, the checkpoint's facts as rank 0
    read them) and names its log folder after the deployment."""
    return {
        "engine": asdict(resolved.engine),
        "checkpoint": str(resolved.checkpoint),
        "model": dict(resolved.model.raw),
        "world_size": resolved.tp_size,
        "deployment_id": deployment_id,
    }


class Worker:
    """One worker process's whole life. `expected` holds settings this rank insists on (from its
    own deployment file); a world whose configuration differs is refused."""

    def __init__(
        self,
        spec: WorldSpec,
        expected: dict[str, Any] | None = None,
        resident_dir: Path | None = None,
    ) -> None:
        """`resident_dir`: this node's resident weight images (see `ModelRunner`)."""
        assert spec.rank > 0, "rank 0 runs the engine, not a worker"
        self.spec = spec
        self.expected = expected
        self.resident_dir = resident_dir
        self.runner: ModelRunner | None = None
        self.digest: str | None = None
        self.generations = 0  # worlds this process has served in
        self.deployment_id: str | None = None  # the deployment rank 0 last pushed
        # Read by the process's supervisor-facing status line (polled, never called back):
        self.generation: int | None = None  # the generation joined now (loading or serving)
        self.is_serving = False  # loaded, executing that generation's commands
        self.ended: str | None = None  # how the last generation ended, one line

    def run(self, stop: threading.Event) -> None:
        """Serve world after world until `stop` is set. Raises `ConfigError` when this rank
        refuses rank 0's configuration or cannot exist in its world (the caller exits)."""
        retry_s = 0.2  # rejoining fast is what heals a world: keep retries frequent and cheap
        while not stop.is_set():
            try:
                world = join_world(self.spec)
            except ConfigError:
                raise
            except Exception as err:  # head not up yet, gone, or moved to a new generation
                log.info("cannot join rank 0 at %s:%d yet: %s", self.spec.head, self.spec.port, err)
                stop.wait(retry_s)
                retry_s = min(retry_s * 2, 1.0)
                continue
            retry_s = 0.2
            self.generation = world.generation
            try:
                self._serve(world)
                self.ended = f"rank 0 left generation {world.generation} in order"
                log.info("%s; waiting for the next", self.ended)
            except ConfigError:
                raise
            except Exception as err:
                self.ended = f"lost generation {world.generation}: {one_line(err)}"
                log.warning("%s", self.ended)
            finally:
                self.generation, self.is_serving = None, False
                world.dissolve()

    def _serve(self, world: World) -> None:
        authenticate_world(self.spec.secret, world.generation, world.rank, world.control_group)
        pushed, refusal = receive_config(world.rank, world.control_group, self.expected)
        if refusal is not None:
            raise ConfigError(f"refusing rank 0's world: {refusal}")
        self.deployment_id = pushed.config.get("deployment_id")
        error = None
        if pushed.digest != self.digest:
            self.runner, self.digest = None, None
            gc.collect()  # the previous model's memory, before loading the next one
            try:
                self.runner = _build_runner(pushed.config, world, self.resident_dir)
                self.digest = pushed.digest
            except DgppError as err:
                error = f"{type(err).__name__}: {err}"
        engine = pushed.config["engine"]
        failures = report_loaded(error, world.control_group, self.spec.timeouts.load_s)
        if error is not None:
            raise ConfigError(f"cannot load {engine['model']!r}: {error}")
        if failures:
            raise RuntimeError("another rank failed to load: " + "; ".join(failures))
        assert self.runner is not None
        self.generations += 1
        self.is_serving = True
        log.info("rank %d serving generation %d", world.rank, world.generation)
        serve_commands(self.runner, ControlChannel(world.rank, world.control_group))


def local_device(device: str, rank: int) -> str:
    """This rank's device: `cuda` means this node's GPU, or, where one machine holds several
    ranks and several GPUs (`dgpp serve --world N`), the GPU of index rank mod count."""
    if device != "cuda":
        return device
    count = torch.cuda.device_count()
    return f"cuda:{rank % count}" if count > 1 else device


def _build_runner(pushed: dict[str, Any], world: World, resident_dir: Path | None) -> ModelRunner:
    config = EngineConfig(**pushed["engine"])
    config = replace(config, device=local_device(config.device, world.rank))
    if config.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(config.device))
    checkpoint = Path(pushed["checkpoint"])
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    # Rank 0's reading of config.json, not this node's copy: one resolution for the world.
    model_config = ModelConfig.from_checkpoint(checkpoint, raw=pushed["model"])
    assert config.max_model_len is not None, "rank 0 pushes the resolved context limit"
    return ModelRunner(
        config,
        model_config,
        checkpoint,
        config.max_model_len,
        world.parallel,
        resident_dir,
        drafter_for(config),
    )
