"""Proofs over the cluster secret: who may sit in a generation and stay in the world.

Every node holds the same secret (a file the playbook provisions; `dgpp serve --world N` makes
one per run). Proofs are HMAC-SHA256 over the secret of a message that names what is proven, the
generation and a random challenge rank 0 chose for it, so a proof is worth nothing in another
generation, for another rank or in another role. Without a secret on rank 0 the rendezvous is
open (a warning is logged) and every proof is accepted.

Two checks use them: a worker's seat in the store carries a proof (so a process without the
secret is refused before any process group exists, with a clear reason), and once the process
group of a generation has formed every rank answers a fresh challenge over it (so a process
that took a seat by writing the store directly still cannot stay in the world). Rank 0 answers
the same challenge, so a worker also knows it joined the real head.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from dgpp.engine.distributed.json_collectives import broadcast_json, gather_json
from dgpp.engine.errors import ConfigError

NO_PROOF = "-"


def new_challenge() -> str:
    return secrets.token_hex(16)


def prove(secret: bytes | None, *parts: object) -> str:
    """The proof of `parts` under `secret` (`NO_PROOF` without one)."""
    if secret is None:
        return NO_PROOF
    message = "/".join(str(part) for part in parts).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify(secret: bytes | None, proof: object, *parts: object) -> bool:
    """Whether `proof` proves `parts` under `secret`; always, without a secret."""
    if secret is None:
        return True
    return isinstance(proof, str) and hmac.compare_digest(proof, prove(secret, *parts))


class SecretMismatch(ConfigError):
    """Another rank does not hold this cluster's secret."""


def authenticate_world(secret: bytes | None, generation: int, rank: int, group: Any) -> None:
    """Every rank of a new world, before anything else is said: rank 0 sends a fresh
    challenge, every rank answers it with its proof. Rank 0 raises `SecretMismatch` naming the
    ranks that failed; a worker raises it when rank 0's own answer is wrong."""
    challenge = broadcast_json(new_challenge() if rank == 0 else None, group, rank)
    if not isinstance(challenge, str):
        raise SecretMismatch("rank 0 sent a malformed challenge")
    answers = gather_json(prove(secret, "world", generation, rank, challenge), group)
    if rank == 0:
        failed = [
            r
            for r, answer in enumerate(answers)
            if r and not verify(secret, answer, "world", generation, r, challenge)
        ]
        if failed:
            names = ", ".join(str(r) for r in failed)
            raise SecretMismatch(
                f"rank(s) {names} of generation {generation} do not hold the cluster secret"
            )
    elif secret is not None and not verify(secret, answers[0], "world", generation, 0, challenge):
        raise SecretMismatch(
            "rank 0 does not hold this node's cluster secret: check the secret file on both"
        )
