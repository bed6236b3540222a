"""What a world is formed with: where its ranks meet (`WorldSpec`) and every deadline of the
distributed runtime, as knobs (`WorldTimeouts`). Apart from `world` so that reading a
deployment (`dgpp deploy validate`, the console) does not import torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dgpp.engine.configuration.knobs import Rule, check_knobs, knob


def _deadline(default: float, help: str, label: str, advanced: bool = True) -> Any:
    """A deadline knob: seconds, positive, in the deployment's `timeouts:` and on the console
    (no flag: the CLI takes three of them from the environment, see `timeout_env`)."""
    return knob(
        default, help, label=label, unit="s", gt=0.0, flag=None, group="timeouts",
        advanced=advanced,
    )  # fmt: skip


@dataclass(frozen=True)
class WorldTimeouts:
    """Every deadline of the distributed runtime, in seconds (knobs:
    `dgpp.engine.configuration.knobs`).

    `collective_s` is also set by env `DGPP_BOUNDARY_TIMEOUT_MS`, `control_deadline_s` by
    `DGPP_CONSUMER_DEADLINE_S`, `step_watchdog_s` by `DGPP_BUS_COMPLETION_TIMEOUT_MS`. Idle
    workers get a heartbeat every `heartbeat_s`, so it must be well below the control deadline.
    """

    KNOB_SECTION: ClassVar[str] = "timeouts"
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            ("heartbeat_s", "control_deadline_s"),
            lambda heartbeat, deadline: heartbeat * 2 <= deadline,
            "{0} ({v0}) must be at most half of {1} ({v1}), or idle workers would declare a "
            "healthy head lost",
        ),
    )

    rendezvous_s: float = _deadline(
        300.0,
        "rank 0 waits this long for every rank of a generation before starting a fresh one",
        "Rendezvous timeout (s)",
    )
    collective_s: float = _deadline(600.0, "one tensor collective", "Collective timeout (s)")
    control_deadline_s: float = _deadline(
        120.0,
        "a worker waits this long for rank 0's next command before it declares the head lost",
        "Control deadline (s)",
    )
    heartbeat_s: float = _deadline(
        1.0, "idle heartbeat to the workers; at most half the control deadline", "Heartbeat (s)"
    )
    step_watchdog_s: float = _deadline(
        600.0, "one whole engine step", "Step watchdog (s)", advanced=False
    )
    load_s: float = _deadline(
        1800.0, "every rank loads its weights within this", "Load timeout (s)", advanced=False
    )
    shutdown_s: float = _deadline(30.0, "an orderly stop", "Shutdown timeout (s)")

    def __post_init__(self) -> None:
        check_knobs(self, prefix="timeouts.")


@dataclass(frozen=True)
class WorldSpec:
    """Where ranks meet. Workers leave `world_size` unset and take `backend` from rank 0."""

    rank: int
    head: str = "127.0.0.1"
    port: int = 29517
    world_size: int | None = None
    backend: str = "gloo"  # "nccl" on CUDA; the control channel always runs on gloo
    timeouts: WorldTimeouts = field(default_factory=WorldTimeouts)
    # The cluster secret every rank holds; None leaves the rendezvous open (rank 0 warns).
    secret: bytes | None = field(default=None, repr=False)
