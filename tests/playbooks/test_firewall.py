"""The head's firewall (role dgpp_firewall) for real: its ruleset, loaded with nft into a network
namespace of its own, lets the cluster node reach the rendezvous port and the client network the
API port, drops everyone else on those two ports, and leaves every other port alone. Four
namespaces joined by veth pairs stand in for the head, a worker, a client and a stranger."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jinja2
import pytest

from tests.playbooks.staging import PLAYBOOKS

TEMPLATE = PLAYBOOKS / "roles/dgpp_firewall/templates/firewall.nft.j2"
RENDEZVOUS, API, OTHER = 29517, 18080, 2222
PEERS = {"worker": "10.77.0", "client": "10.77.1", "stranger": "10.77.2"}

pytestmark = pytest.mark.skipif(
    shutil.which("nft") is None or shutil.which("ip") is None,
    reason="needs nftables and iproute2 (apt-get install nftables iproute2) and root",
)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


def render(cluster: list[str], clients: list[str]) -> str:
    """The role's template, with the lists the role's vars split by address family."""
    template = jinja2.Template(TEMPLATE.read_text(), trim_blocks=True)
    return template.render(
        dgpp_firewall_rendezvous_port=RENDEZVOUS,
        dgpp_firewall_http_port=API,
        dgpp_firewall_cluster_v4=[a for a in cluster if ":" not in a],
        dgpp_firewall_cluster_v6=[a for a in cluster if ":" in a],
        dgpp_firewall_clients_v4=[a for a in clients if ":" not in a],
        dgpp_firewall_clients_v6=[a for a in clients if ":" in a],
    )


@pytest.fixture
def network(tmp_path: Path) -> Iterator[str]:
    """Namespaces dgppfw-head and one per peer; returns the prefix of their names."""
    prefix = f"dgppfw{tmp_path.name[-6:]}".replace("_", "")
    names = [f"{prefix}-head", *(f"{prefix}-{peer}" for peer in PEERS)]
    if _run("ip", "netns", "add", names[0], check=False).returncode != 0:
        pytest.skip("cannot create network namespaces here (needs root)")
    try:
        for index, (peer, net) in enumerate(PEERS.items()):
            name = f"{prefix}-{peer}"
            _run("ip", "netns", "add", name)
            inside, outside = f"fw{index}a", f"fw{index}b"
            _run(
                "ip",
                "link",
                "add",
                inside,
                "netns",
                names[0],
                "type",
                "veth",
                "peer",
                outside,
                "netns",
                name,
            )
            _run("ip", "-n", names[0], "addr", "add", f"{net}.1/24", "dev", inside)
            _run("ip", "-n", name, "addr", "add", f"{net}.2/24", "dev", outside)
            for namespace, link in ((names[0], inside), (name, outside)):
                _run("ip", "-n", namespace, "link", "set", link, "up")
                _run("ip", "-n", namespace, "link", "set", "lo", "up")
        yield prefix
    finally:
        for name in names:
            _run("ip", "netns", "del", name, check=False)


LISTEN = """
import socket, sys, threading
ports = [int(p) for p in sys.argv[1:]]
servers = []
for port in ports:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(16); servers.append(s)
def serve(s):
    while True:
        c, _ = s.accept(); c.close()
for s in servers:
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).close()
    print("open")
except OSError:
    print("closed")
"""


def _reaches(prefix: str, peer: str, port: int) -> bool:
    head = f"{PEERS[peer]}.1"
    result = _run(
        "ip", "netns", "exec", f"{prefix}-{peer}", sys.executable, "-c", CONNECT, head, str(port)
    )
    return result.stdout.strip() == "open"


def test_only_the_cluster_reaches_the_rendezvous_and_only_clients_the_api(
    network: str, tmp_path: Path
) -> None:
    ruleset = tmp_path / "firewall.nft"
    ruleset.write_text(render(cluster=["10.77.0.2"], clients=["10.77.1.0/24"]))
    head = f"{network}-head"
    assert _run("ip", "netns", "exec", head, "nft", "--check", "-f", str(ruleset)).returncode == 0
    listener = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            head,
            sys.executable,
            "-c",
            LISTEN,
            *map(str, (RENDEZVOUS, API, OTHER)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        # Before the ruleset: every port answers everyone.
        assert all(_reaches(network, peer, RENDEZVOUS) for peer in PEERS)
        _run("ip", "netns", "exec", head, "nft", "-f", str(ruleset))
        _run("ip", "netns", "exec", head, "nft", "-f", str(ruleset))  # reloading is idempotent
        tables = _run("ip", "netns", "exec", head, "nft", "list", "tables").stdout
        assert tables.count("table inet dgpp") == 1
        reach = {
            (peer, port): _reaches(network, peer, port)
            for peer in PEERS
            for port in (RENDEZVOUS, API, OTHER)
        }
        assert reach == {
            ("worker", RENDEZVOUS): True,
            ("worker", API): False,
            ("worker", OTHER): True,
            ("client", RENDEZVOUS): False,
            ("client", API): True,
            ("client", OTHER): True,
            ("stranger", RENDEZVOUS): False,
            ("stranger", API): False,
            ("stranger", OTHER): True,  # every other port is left as it was
        }
        # Without client networks the API stays open to everyone (the key still guards it).
        ruleset.write_text(render(cluster=["10.77.0.2"], clients=[]))
        _run("ip", "netns", "exec", head, "nft", "-f", str(ruleset))
        assert _reaches(network, "stranger", API) and not _reaches(network, "stranger", RENDEZVOUS)
        # The unit's ExecStop: the table goes, and with it every rule.
        _run("ip", "netns", "exec", head, "nft", "delete", "table", "inet", "dgpp")
        assert _reaches(network, "stranger", RENDEZVOUS)
    finally:
        listener.kill()
        listener.wait()
