"""A private network for test hosts: network namespaces joined by veth pairs on one bridge.

`ip netns add` makes one namespace per host and a `hub` namespace holding the bridge; each host
gets a veth whose far end is enslaved to the bridge, and an address on `10.231.N.0/24`. The hub
has `.1` and is where the test runs its controller (`ip netns exec <hub> ansible-playbook`), so
nothing is added to this machine's own network namespace, and `close()` deletes every namespace
(and with them the veths and the bridge).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

NETNS_DIR = Path("/run/netns")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class ClusterNetwork:
    """`hosts` namespaces on one bridge: `address(name)`, `path(name)`, `hub_command(...)`."""

    def __init__(self, hosts: list[str], subnet: int = 231) -> None:
        self.tag = f"dgpp{os.getpid() % 100000}"
        self.hosts = hosts
        self.prefix = f"10.{subnet}.0"
        self.hub = f"{self.tag}-hub"
        self._made: list[str] = []

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{self.hosts.index(host)}"

    def path(self, host: str) -> Path:
        """The namespace's file, for `systemd-nspawn --network-namespace-path=`."""
        return NETNS_DIR / self.namespace(host)

    def address(self, host: str) -> str:
        return f"{self.prefix}.{10 + self.hosts.index(host)}"

    @property
    def hub_address(self) -> str:
        return f"{self.prefix}.1"

    def open(self) -> ClusterNetwork:
        for name in (self.hub, *map(self.namespace, self.hosts)):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{self.hub_address}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            outside, inside = f"{self.tag}-v{index}", "eth0"
            _ip("-n", self.hub, "link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("-n", self.hub, "link", "set", inside, "netns", self.namespace(host))
            _ip("-n", self.hub, "link", "set", outside, "master", "br0", "up")
            own = self.namespace(host)
            _ip("-n", own, "addr", "add", f"{self.address(host)}/24", "dev", inside)
            _ip("-n", own, "link", "set", inside, "up")
        return self

    def hub_command(self, command: list[str]) -> list[str]:
        """`command` run in the hub namespace (the controller's seat on the network)."""
        return ["ip", "netns", "exec", self.hub, *command]

    def close(self) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)
        self._made.clear()
