"""The interface a rank's collectives use: the one whose route reaches the head
(`engine/distributed/interface.py`), checked on loopback and in network namespaces made here
(two hosts on a veth pair, as two nodes on their cluster link)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from dgpp.engine.distributed.interface import (
    VARIABLES,
    pin_collective_interface,
    route_interface,
)


@pytest.fixture
def no_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def test_the_loopback_head_is_reached_over_lo() -> None:
    assert route_interface("127.0.0.1", 29517) == ("lo", "127.0.0.1")


@pytest.mark.usefixtures("no_pins")
def test_unset_variables_are_pinned_to_the_route() -> None:
    assert pin_collective_interface("127.0.0.1", 29517) == "lo"
    assert [os.environ[variable] for variable in VARIABLES] == ["lo", "lo"]


@pytest.mark.usefixtures("no_pins")
def test_the_operators_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "enp1s0f0np0")
    pin_collective_interface("127.0.0.1", 29517)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "enp1s0f0np0"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"


PROBE = "from dgpp.engine.distributed.interface import route_interface as r; print(r({!r}, 1))"


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (netns)"
)
def test_a_worker_picks_its_cluster_link_not_loopback() -> None:
    """Two namespaces joined by a veth pair: from the worker's side the head's address routes
    through its own end of the pair, and the head finds the interface holding its address."""
    tag = f"dgppif{os.getpid() % 100000}"
    head, worker = f"{tag}-h", f"{tag}-w"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def probe(namespace: str, address: str) -> str:
        command = ["ip", "netns", "exec", namespace, sys.executable, "-c", PROBE.format(address)]
        return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()

    try:
        for namespace in (head, worker):
            ip("netns", "add", namespace)
        ip("-n", head, "link", "add", "link0", "type", "veth", "peer", "name", "link1")
        ip("-n", head, "link", "set", "link1", "netns", worker)
        for namespace, device, address in (
            (head, "link0", "10.77.0.1"),
            (worker, "link1", "10.77.0.2"),
        ):
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", device)
            ip("-n", namespace, "link", "set", device, "up")
        assert probe(worker, "10.77.0.1") == "('link1', '10.77.0.2')"
        assert probe(head, "10.77.0.1") == "('link0', '10.77.0.1')"
        assert probe(worker, "10.88.0.1") == "None"  # no route there: gloo keeps its own pick
    finally:
        for namespace in (head, worker):
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
