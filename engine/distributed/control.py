"""Rank 0 decides, the other ranks execute: a closed set of commands broadcast from rank 0.

Each command is a header tensor [command, payload length, pixel values] and, for a step, the
step message as one int64 tensor (`dgpp.engine.execution.step_message`), then the pixels of the
images it has the vision encoder run on (float32, once per image: the ranks keep the encoder's
outputs): nothing is pickled, and what crosses the cluster link per step follows the step's work,
not the contexts' length.
"""

from __future__ import annotations

import enum
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from dgpp.engine.execution.model_runner import ModelRunner
from dgpp.engine.execution.step_message import StepMessage


class Command(enum.IntEnum):
    STEP = 1  # run one forward for the payload's step message
    WARM_UP = 2  # run the runner's warm-up forward
    HEARTBEAT = 3  # nothing to do; rank 0 is alive (sent while idle)
    SHUTDOWN = 4  # rank 0 is leaving in order: dissolve this world
    DRAFT = 5  # run the MTP layer over the payload's draft message (speculative=mtp)


_WITH_MESSAGE = (Command.STEP, Command.DRAFT)


class ControlChannel:
    """Carries rank 0's commands to every rank of the group, in order. The group is gloo (CPU)
    whatever carries the tensors, and its timeout is the workers' deadline for the next command."""

    def __init__(self, rank: int, group: Any) -> None:
        self.rank = rank
        self.group = group
        self.num_bytes_sent = 0  # headers and payloads, rank 0's side
        self.num_steps_sent = 0

    def send(self, command: Command, message: StepMessage | None = None) -> None:
        """Rank 0 only. A step or a draft pass carries its message; no other command has one."""
        assert self.rank == 0, "only rank 0 sends commands"
        assert (command in _WITH_MESSAGE) == (message is not None), "a step or draft, only"
        payload = message.to_tensor() if message is not None else None
        pixels = None
        if message is not None and message.pixels is not None:
            pixels = message.pixels.detach().to("cpu", torch.float32).reshape(-1)
        header = torch.tensor(
            [
                command,
                0 if payload is None else payload.numel(),
                0 if pixels is None else pixels.numel(),
            ]
        )
        dist.broadcast(header, src=0, group=self.group)
        self.num_bytes_sent += header.nbytes
        if payload is not None:
            dist.broadcast(payload, src=0, group=self.group)
            self.num_bytes_sent += payload.nbytes
            self.num_steps_sent += command is Command.STEP
        if pixels is not None:
            dist.broadcast(pixels, src=0, group=self.group)
            self.num_bytes_sent += pixels.nbytes

    def receive(self) -> tuple[Command, StepMessage | None]:
        """Any other rank: block until rank 0's next command."""
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        command, length, num_pixels = Command(int(header[0])), int(header[1]), int(header[2])
        if command not in _WITH_MESSAGE:
            return command, None
        payload = torch.zeros(length, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.group)
        message = StepMessage.from_tensor(payload)
        if not num_pixels:
            return command, message
        pixels = torch.zeros(num_pixels, dtype=torch.float32)
        dist.broadcast(pixels, src=0, group=self.group)
        return command, replace(message, pixels=pixels)


def serve_commands(runner: ModelRunner, channel: ControlChannel) -> None:
    """A worker rank's life in one world: run each step rank 0 sends, until it leaves in order.
    A dead rank 0 or a missed deadline surfaces as the collective's exception."""
    runner.forget_world()  # a new world: rank 0 starts from empty tables too
    if runner.disk is not None:  # and with no read from disk in flight
        runner.disk.drain()
    while True:
        command, message = channel.receive()
        if command is Command.SHUTDOWN:
            if runner.disk is not None:  # the prefix blocks queued reach the disk first
                runner.disk.flush()
            return
        if command is Command.STEP:
            assert message is not None
            runner.execute(message)
        elif command is Command.WARM_UP:
            runner.warm_up()
        elif command is Command.DRAFT:
            assert message is not None
            runner.draft(message)
