"""Rank 0's rendezvous store listens on `rendezvous.head` only, refuses an address this machine
lacks with a clear error, and owns its listening descriptor (real sockets on loopback)."""

from __future__ import annotations

import gc
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from dgpp.engine.distributed.world import Rendezvous, WorldSpec
from dgpp.engine.errors import ConfigError
from tests.engine.distributed.test_tensor_parallel import _free_port


def _spec(head: str, port: int) -> WorldSpec:
    return WorldSpec(rank=0, head=head, port=port, world_size=2)


def _reaches(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _client_reads(port: int, key: str) -> str:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    return client.get(key).decode()


def test_the_store_listens_on_the_head_address_only() -> None:
    port = _free_port()
    rendezvous = Rendezvous(_spec("127.0.0.1", port))
    assert _client_reads(port, "dgpp/world_size") == "2"
    # 127.0.0.2 is this machine too (all of 127/8 is loopback): a store on every interface
    # would answer there.
    assert not _reaches("127.0.0.2", port)
    del rendezvous


def test_a_head_address_this_machine_lacks_is_refused_clearly() -> None:
    with pytest.raises(ConfigError, match=r"cannot listen on the rendezvous address 192\.0\.2\.1:"):
        Rendezvous(_spec("192.0.2.1", _free_port()))  # TEST-NET-1: never assigned here


def test_a_dropped_store_does_not_close_a_later_store_s_listener() -> None:
    """The store closes its descriptor when it goes; nothing else may close that number again
    (the next listener reuses it)."""
    first = Rendezvous(_spec("127.0.0.1", _free_port()))
    del first.store  # the store goes first, its descriptor number is free again
    gc.collect()
    port = _free_port()
    second = Rendezvous(_spec("127.0.0.1", port))
    del first
    gc.collect()
    assert _client_reads(port, "dgpp/world_size") == "2"
    del second
