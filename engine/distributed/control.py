"""Rank 0 decides, the other ranks execute: a closed set of commands broadcast from rank 0."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch.distributed as dist

from dgpp.engine.model_runner import ModelRunner, StepInputs
from dgpp.engine.parallel import ParallelContext


class Command(enum.Enum):
    STEP = "step"  # run one forward with the payload's inputs
    SHUTDOWN = "shutdown"  # leave the worker loop in order


@dataclass(frozen=True)
class ControlMessage:
    command: Command
    inputs: StepInputs | None = None


class ControlChannel:
    """Carries rank 0's commands to every rank of the group, in order."""

    def __init__(self, parallel: ParallelContext) -> None:
        self.parallel = parallel

    def send(self, message: ControlMessage) -> None:
        """Rank 0 only."""
        assert self.parallel.tp_rank == 0, "only rank 0 sends commands"
        dist.broadcast_object_list([message], src=0, group=self.parallel.group)

    def receive(self) -> ControlMessage:
        """Any other rank: block until rank 0's next command."""
        box: list[ControlMessage | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.parallel.group)
        message = box[0]
        assert isinstance(message, ControlMessage)
        return message


def serve_commands(runner: ModelRunner, channel: ControlChannel) -> None:
    """A worker rank's whole life after loading: run each step rank 0 sends, until shutdown."""
    while True:
        message = channel.receive()
        if message.command is Command.SHUTDOWN:
            return
        assert message.inputs is not None
        runner.execute(message.inputs)
