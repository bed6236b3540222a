"""Which network interface a rank's collectives use: the one that reaches the head.

Gloo (and NCCL's bootstrap) pick their socket address by resolving the machine's hostname. Where
that name does not resolve (a fresh install with no entry in /etc/hosts, a container) gloo falls
back to the loopback address, announces 127.0.0.1 to its peers, and the world never forms: the
head waits for a rank that did join the store but cannot be reached. Where it resolves to the
office LAN instead of the cluster link, collectives take the slow path. Every rank knows the
head's rendezvous address, and the interface its route to the head leaves by is the cluster link,
so each rank pins `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME` to it, unless the operator set
them (their value always wins).
"""

from __future__ import annotations

import logging
import os
import socket

import psutil

log = logging.getLogger(__name__)

VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def route_interface(head: str, port: int) -> tuple[str, str] | None:
    """(interface name, local address) this machine reaches `head` from, or None when there is
    no route or the address is on no interface. A UDP `connect` sends nothing: the kernel only
    picks the route and the source address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(head, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(item.address.split("%")[0] == local for item in addresses):
            return name, local
    return None


def pin_collective_interface(head: str, port: int) -> str | None:
    """Set the unset socket-interface variables to the interface that reaches `head`; returns
    the interface chosen (None: nothing found, the libraries keep their own choice)."""
    if all(os.environ.get(name) for name in VARIABLES):
        return os.environ["GLOO_SOCKET_IFNAME"]
    found = route_interface(head, port)
    if found is None:
        log.warning("no interface routes to the head %s; gloo picks its own address", head)
        return None
    name, local = found
    for variable in VARIABLES:
        os.environ.setdefault(variable, name)
    log.info("collectives use interface %s (%s), the route to the head %s", name, local, head)
    return name
