"""A worker rank (rank > 0): load this rank's weight shards, then execute rank 0's steps."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dgpp.engine.config import EngineConfig, ModelConfig
from dgpp.engine.distributed.control import ControlChannel, serve_commands
from dgpp.engine.distributed.world import WorldSpec, join_world, leave_world
from dgpp.engine.model_runner import ModelRunner
from dgpp.engine.parallel import ParallelContext


def run_worker(config: EngineConfig, checkpoint: Path, spec: WorldSpec) -> None:
    assert spec.rank > 0, "rank 0 runs the engine, not a worker"
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    try:
        _load_and_serve(config, checkpoint, join_world(spec))
    finally:
        leave_world()  # after the runner (which holds the process group) is gone


def _load_and_serve(config: EngineConfig, checkpoint: Path, parallel: ParallelContext) -> None:
    model_config = ModelConfig.from_checkpoint(checkpoint)
    max_model_len = config.effective_max_model_len(model_config)
    config = replace(config, max_model_len=max_model_len)
    runner = ModelRunner(config, model_config, checkpoint, max_model_len, parallel)
    serve_commands(runner, ControlChannel(parallel))
