"""Collectives for small JSON values: the handshake's configuration, answers and load outcomes.

Values travel as UTF-8 JSON in uint8 tensors, so a rank only ever parses what a peer sends: a
peer's bytes are never unpickled (`broadcast_object_list` and `all_gather_object` unpickle, which
runs whatever code the sender put there). A value that does not parse raises `MalformedPeerData`.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

# The handshake's largest value is the pushed configuration (a few KiB); a peer announcing more
# than this is refused before anything is allocated for it.
MAX_BYTES = 1 << 20


class MalformedPeerData(ValueError):
    """A peer sent bytes that are not the JSON value the protocol expects."""


def _encode(value: Any) -> torch.Tensor:
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    if len(data) > MAX_BYTES:
        raise ValueError(f"a handshake value of {len(data)} bytes exceeds {MAX_BYTES}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(tensor: torch.Tensor, sender: int) -> Any:
    try:
        return json.loads(bytes(tensor.to(torch.uint8).tolist()).decode())
    except (UnicodeDecodeError, ValueError):
        raise MalformedPeerData(f"rank {sender} sent data that is not JSON") from None


def _length(length: int, sender: int) -> int:
    if not 0 < length <= MAX_BYTES:
        raise MalformedPeerData(f"rank {sender} announced {length} bytes")
    return length


def broadcast_json(value: Any, group: Any, rank: int) -> Any:
    """Rank 0's `value` on every rank of `group` (rank 0 passes it, the others None)."""
    payload = _encode(value) if rank == 0 else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    length = _length(int(size[0]), 0)
    buffer = payload if payload is not None else torch.zeros(length, dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    return value if rank == 0 else _decode(buffer, 0)


def gather_json(value: Any, group: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank of `group`."""
    payload = _encode(value)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    lengths = [_length(int(size[0]), sender) for sender, size in enumerate(sizes)]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(buffers, padded, group=group)
    return [
        _decode(buffer[:length], sender)
        for sender, (buffer, length) in enumerate(zip(buffers, lengths, strict=True))
    ]
