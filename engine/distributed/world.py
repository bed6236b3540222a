"""Forms tensor-parallel worlds over torch.distributed, one generation at a time.

Rank 0 owns the rendezvous: a TCP store on the head's rendezvous port that outlives every world it
forms. Each formation is a new *generation*: workers announce themselves under the generation's
keys, rank 0 says "go" once every rank is there, and all ranks then create the process groups under
a store prefix of that generation. A world that breaks (a rank died, a collective timed out) is
dissolved and the next generation formed on the same port, so surviving ranks keep their weights
and only the lost rank starts again. A worker needs only the head's address, the port, its rank
and the cluster secret: the world size comes from the store.

The store listens on the head's address only (a socket of our own, bound to `rendezvous.head`,
handed to the store as `master_listen_fd`). Each generation has a random challenge; a worker's
seat carries a proof over the cluster secret (`cluster_secret`), and rank 0 refuses a seat
without a valid one, telling its holder why.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.distributed.cluster_secret import SecretMismatch, new_challenge, prove, verify
from dgpp.engine.distributed.interface import pin_collective_interface
from dgpp.engine.distributed.world_spec import WorldSpec
from dgpp.engine.errors import ConfigError

log = logging.getLogger(__name__)

_PREFIX = "dgpp"
_POLL_S = 0.2


@dataclass
class World:
    """One generation of the world, as this rank sees it."""

    generation: int
    rank: int
    size: int
    control_group: Any  # a gloo group, so commands flow on CPU whatever the tensor backend

    @property
    def parallel(self) -> ParallelContext:
        # group=None: the current default group, so the model built for one generation keeps
        # working in the next.
        return ParallelContext(tp_rank=self.rank, tp_size=self.size, group=None)

    def dissolve(self) -> None:
        """Drop this generation's process groups (after a failure: without waiting for peers)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def leave_world() -> None:
    """Orderly exit: wait until every rank is leaving, then tear down. Callers drop everything
    that holds a process group first: a group object that outlives `destroy_process_group` is
    destroyed during interpreter teardown with its threads still joinable, which aborts the
    process ("terminate called without an active exception")."""
    if dist.is_initialized():
        import gc

        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


class Rendezvous:
    """Rank 0's side: the store on the rendezvous port, and one `form()` per generation."""

    def __init__(self, spec: WorldSpec) -> None:
        assert spec.rank == 0 and spec.world_size is not None
        self.spec = spec
        self.world_size = spec.world_size
        self.generation = 0
        self.missing: tuple[int, ...] = tuple(range(1, spec.world_size))
        if spec.secret is None:
            log.warning(
                "the rendezvous on %s:%d is not authenticated (no cluster secret): any host "
                "that reaches it can join as a missing rank",
                spec.head,
                spec.port,
            )
        listener = _listen(spec.head, spec.port)
        try:
            self.store = dist.TCPStore(
                spec.head,
                spec.port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=spec.timeouts.rendezvous_s),
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        # The store owns the descriptor now and closes it when it goes; a socket object that
        # still held it would close it a second time, when collected, by then perhaps another
        # store's listener that reused the number.
        listener.detach()
        self._challenge = ""
        self._refused: set[str] = set()
        self.store.set(f"{_PREFIX}/world_size", str(spec.world_size))
        self.store.set(f"{_PREFIX}/backend", spec.backend)

    def form(self) -> World:
        """Open the next generation and block until every rank has joined it. A generation that
        is not complete within `rendezvous_s` is abandoned for a fresh one (a rank that announced
        itself and died must not stall the world)."""
        timeouts = self.spec.timeouts
        while True:
            self.generation += 1
            generation = self.generation
            self._challenge = new_challenge()
            self.store.set(f"{_PREFIX}/g{generation}/challenge", self._challenge)
            self.store.set(f"{_PREFIX}/generation", str(generation))
            deadline = time.monotonic() + timeouts.rendezvous_s
            next_report = time.monotonic() + 10.0
            while True:
                self.missing = self._missing(generation)
                if not self.missing:
                    break
                if time.monotonic() > deadline:
                    log.warning(
                        "generation %d: ranks %s did not join within %.0f s; starting over",
                        generation,
                        _ranks(self.missing),
                        timeouts.rendezvous_s,
                    )
                    break
                if time.monotonic() > next_report:
                    log.info("waiting for ranks %s to join", _ranks(self.missing))
                    next_report = time.monotonic() + 30.0
                time.sleep(_POLL_S)
            if not self.missing:
                break
        self.store.set(f"{_PREFIX}/g{generation}/go", "1")
        return _init_groups(self.store, generation, 0, self.world_size, self.spec)

    def _missing(self, generation: int) -> tuple[int, ...]:
        return tuple(
            rank for rank in range(1, self.world_size) if not self._seated(generation, rank)
        )

    def _seated(self, generation: int, rank: int) -> bool:
        """Whether the rank's seat holds a claim with a valid proof; an invalid claim is
        refused (its holder reads why) and the seat freed for the real rank."""
        seat = f"{_PREFIX}/g{generation}/rank{rank}"
        if not self.store.check([seat]):
            return False
        claim = self.store.get(seat).decode()
        holder, _, proof = claim.rpartition(" ")
        if holder and verify(
            self.spec.secret, proof, "seat", generation, rank, self._challenge, holder
        ):
            return True
        if claim not in self._refused:
            self._refused.add(claim)
            log.warning(
                "refused %s as rank %d of generation %d: it does not hold the cluster secret",
                holder or "a claim without a holder",
                rank,
                generation,
            )
        self.store.set(f"{_PREFIX}/refused/{claim}", "the cluster secret differs")
        self.store.delete_key(seat)
        return False


def join_world(spec: WorldSpec) -> World:
    """A worker's side: connect to rank 0's store (waiting up to `rendezvous_s` for it to come
    up), join the current generation, and wait for every other rank. The world size and the
    tensor backend are rank 0's. Raises `ConfigError` for a rank this world cannot hold, and
    `RendezvousLost` when the head moved on or went away."""
    assert spec.rank > 0
    timeouts = spec.timeouts
    store = dist.TCPStore(
        spec.head,
        spec.port,
        is_master=False,
        timeout=timedelta(seconds=timeouts.rendezvous_s),
    )
    world_size = int(store.get(f"{_PREFIX}/world_size"))
    if spec.rank >= world_size:
        raise ConfigError(f"rank {spec.rank} does not exist in rank 0's world of {world_size}")
    spec = replace(spec, backend=store.get(f"{_PREFIX}/backend").decode())
    generation = int(store.get(f"{_PREFIX}/generation"))
    challenge = store.get(f"{_PREFIX}/g{generation}/challenge").decode()
    me = f"{socket.gethostname()}:{os.getpid()}:{time.monotonic_ns()}"
    claim = f"{me} {prove(spec.secret, 'seat', generation, spec.rank, challenge, me)}"
    seat = f"{_PREFIX}/g{generation}/rank{spec.rank}"
    holder = store.compare_set(seat, "", claim).decode()
    if holder != claim:
        # This rank's seat in the generation is taken: by this process before the world broke,
        # by a dead predecessor rank 0 has not noticed yet, or by a duplicate. Wait for the next.
        raise RendezvousLost(f"rank {spec.rank} of generation {generation} is held by {holder}")
    go = f"{_PREFIX}/g{generation}/go"
    # One read of "go" per round decides: rank 0 sets it only after it checked every seat, so
    # a seat that still holds this claim then is this rank's.
    while not store.check([go]):
        if store.check([f"{_PREFIX}/refused/{claim}"]):
            raise SecretMismatch(
                f"rank 0 at {spec.head}:{spec.port} refused this rank: the cluster secret "
                "differs (or this node has none)"
            )
        if int(store.get(f"{_PREFIX}/generation")) != generation:
            raise RendezvousLost(f"rank 0 abandoned generation {generation}")
        time.sleep(_POLL_S)
    if not _holds(store, seat, claim):  # the generation started without this claim
        raise RendezvousLost(f"rank {spec.rank} of generation {generation} went to another")
    return _init_groups(store, generation, spec.rank, world_size, spec)


def _holds(store: Any, seat: str, claim: str) -> bool:
    return store.check([seat]) and store.get(seat).decode() == claim


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host` (the head's address) and `port` only, for the store."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as err:
        listener.close()
        raise ConfigError(
            f"cannot listen on the rendezvous address {host}:{port}: {err.strerror} (is "
            "rendezvous.head one of this machine's addresses, and the port free?)"
        ) from None
    listener.listen(128)
    listener.set_inheritable(False)
    return listener


class RendezvousLost(RuntimeError):
    """The generation this rank joined will not form; join the next one."""


def _init_groups(store: Any, generation: int, rank: int, size: int, spec: WorldSpec) -> World:
    timeouts = spec.timeouts
    pin_collective_interface(spec.head, spec.port)
    dist.init_process_group(
        backend=spec.backend,
        store=dist.PrefixStore(f"{_PREFIX}/g{generation}/pg", store),
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeouts.collective_s),
    )
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeouts.control_deadline_s))
    log.info("generation %d formed: rank %d of %d", generation, rank, size)
    return World(generation=generation, rank=rank, size=size, control_group=control)


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(rank) for rank in ranks)
