"""The first words of every generation: rank 0 pushes the effective configuration, every rank
checks it (software version, digest, and any expectations of its own) and answers; one refusal
and the world does not start. Everything here travels as JSON (`json_collectives`): no rank
unpickles what another sends."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from dgpp.engine.distributed.json_collectives import (
    MalformedPeerData,
    broadcast_json,
    gather_json,
)
from dgpp.engine.errors import ConfigError


def software_version() -> str:
    from importlib.metadata import version

    return f"dgpp {version('dgpp')}, torch {torch.__version__}"


def config_digest(config: dict[str, Any]) -> str:
    """A digest of a JSON-able configuration, independent of key order."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class WorldConfig:
    """What rank 0 pushes: the engine configuration (as plain data), the checkpoint path every
    rank reads, and the digest and software version every rank must share."""

    config: dict[str, Any]
    digest: str
    version: str

    @classmethod
    def of(cls, config: dict[str, Any]) -> WorldConfig:
        return cls(config=config, digest=config_digest(config), version=software_version())


def differences(expected: dict[str, Any], pushed: dict[str, Any], path: str = "") -> list[str]:
    """Every key of `expected` whose value `pushed` does not share, as 'path: here X, rank 0 Y'."""
    found: list[str] = []
    for key, value in expected.items():
        where = f"{path}{key}"
        other = pushed.get(key, "<absent>")
        if isinstance(value, dict) and isinstance(other, dict):
            found.extend(differences(value, other, f"{where}."))
        elif value != other:
            found.append(f"{where}: this rank has {value!r}, rank 0 has {other!r}")
    return found


def check(pushed: WorldConfig, expected: dict[str, Any] | None) -> str | None:
    """This rank's verdict on rank 0's configuration: None to accept, else why not."""
    mine = software_version()
    if pushed.version != mine:
        return f"software differs: rank 0 runs {pushed.version}, this rank {mine}"
    if config_digest(pushed.config) != pushed.digest:
        return "the configuration arrived damaged (digest mismatch)"
    if expected is not None:
        found = differences(expected, pushed.config)
        if found:
            return "configuration differs: " + "; ".join(found)
    return None


def push_config(pushed: WorldConfig, control_group: Any) -> None:
    """Rank 0: send the configuration and collect every rank's answer; raise `ConfigError`
    naming each refusal (a malformed answer is one)."""
    broadcast_json(asdict(pushed), control_group, rank=0)
    refusals = []
    for rank, answer in enumerate(gather_json(None, control_group)):
        if rank == 0:
            continue
        if not isinstance(answer, dict) or answer.get("rank") != rank:
            refusals.append(f"rank {rank} sent a malformed answer")
        elif answer.get("refusal") is not None:
            refusals.append(f"rank {rank} refused the configuration: {answer['refusal']}")
    if refusals:
        raise ConfigError("; ".join(refusals))


def receive_config(
    rank: int, control_group: Any, expected: dict[str, Any] | None
) -> tuple[WorldConfig, str | None]:
    """A worker: receive rank 0's configuration, answer it; returns it with this rank's
    refusal (None when accepted)."""
    value = broadcast_json(None, control_group, rank=rank)
    try:
        pushed = WorldConfig(**value)
    except TypeError:
        raise MalformedPeerData("rank 0 sent a malformed configuration") from None
    refusal = check(pushed, expected)
    gather_json({"rank": rank, "refusal": refusal}, control_group)
    return pushed, refusal


def report_loaded(error: str | None, control_group: Any, load_timeout_s: float) -> list[str]:
    """Every rank, after loading: wait (up to `load_timeout_s`) until all ranks have loaded or
    failed to, then share the outcome; returns every rank's error, in rank order."""
    from datetime import timedelta

    dist.monitored_barrier(
        group=control_group, timeout=timedelta(seconds=load_timeout_s), wait_all_ranks=True
    )
    outcomes = gather_json(error, control_group)
    return [
        f"rank {rank}: {err if isinstance(err, str) else 'a malformed load report'}"
        for rank, err in enumerate(outcomes)
        if err is not None
    ]
