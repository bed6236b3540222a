"""Rank 0 decides, the other ranks execute: a closed set of commands broadcast from rank 0."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dgpp.engine.model_runner import ModelRunner, StepInputs


class Command(enum.Enum):
    STEP = "step"  # run one forward with the payload's inputs
    HEARTBEAT = "heartbeat"  # nothing to do; rank 0 is alive (sent while idle)
    SHUTDOWN = "shutdown"  # rank 0 is leaving in order: dissolve this world


@dataclass(frozen=True)
class ControlMessage:
    command: Command
    inputs: StepInputs | None = None


class ControlChannel:
    """Carries rank 0's commands to every rank of the group, in order. The group is gloo (CPU)
    whatever carries the tensors, and its timeout is the workers' deadline for the next command."""

    def __init__(self, rank: int, group: Any) -> None:
        self.rank = rank
        self.group = group

    def send(self, message: ControlMessage) -> None:
        """Rank 0 only."""
        assert self.rank == 0, "only rank 0 sends commands"
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> ControlMessage:
        """Any other rank: block until rank 0's next command."""
        box: list[ControlMessage | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        message = box[0]
        assert isinstance(message, ControlMessage)
        return message


def serve_commands(runner: ModelRunner, channel: ControlChannel) -> None:
    """A worker rank's life in one world: run each step rank 0 sends, until it leaves in order.
    A dead rank 0 or a missed deadline surfaces as the collective's exception."""
    while True:
        message = channel.receive()
        if message.command is Command.SHUTDOWN:
            return
        if message.command is Command.STEP:
            assert message.inputs is not None
            runner.execute(message.inputs)
