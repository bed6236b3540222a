"""What the model runner hands a drafter that runs layers of its own beside the model (MTP),
and what it asks of one.

The runner does not know how a draft is made: its builder hands it a `Drafter` (a callable, or
None), and the runner calls it once, after its model is built and before its KV pools are
sized, with a `DraftTarget`: the model and where it runs. The drafter's layers read the same
block tables; their caches are allocated with the target's (`Drafting.caches`). After every
step the runner keeps that step's hidden states for the drafter (`keep`), and a draft pass
(`draft`) runs the drafter's layers over a draft message on every rank. The MTP drafter
(`dgpp.engine.speculative.mtp_runner`) implements it; importing it from here would run the
runner's imports both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.execution.step_message import BlockTables, StepMessage


@dataclass(frozen=True)
class DraftTarget:
    """The runner's model and where it runs: what a drafter builds its own layers beside."""

    model_config: ModelConfig
    model: torch.nn.Module
    parallel: ParallelContext
    attention: Any  # the model's attention backend, which the drafter's layers share
    checkpoint: Path
    dtype: torch.dtype
    device: torch.device
    num_blocks: int  # the KV pool's blocks: the drafter's caches are as large
    block_size: int


class Drafting(Protocol):
    """A drafter's layers on one rank: their caches (allocated with the target's), the last
    step's hidden states kept, and a draft pass."""

    layer: torch.nn.Module
    caches: list[torch.Tensor]

    def keep(self, message: StepMessage, hidden: torch.Tensor) -> None: ...

    def draft(
        self, message: StepMessage, tables: BlockTables, block_size: int, config: EngineConfig
    ) -> list[tuple[int, ...]]: ...


Drafter = Callable[[DraftTarget], Drafting]
