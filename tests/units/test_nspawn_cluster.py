"""`playbooks/cluster.yml` over SSH into two booted containers (see `container.py`), a two-node
cluster on a private bridge (`cluster_net.py`): Ansible runs in the bridge's namespace as an
operator's laptop would, reaches each container's own sshd, and the containers' systemd runs
what the roles install; rank 0 on `spark-0` and rank 1 on `spark-1` form a world of 2 of the
default model over gloo across the bridge. Then `systemctl restart dgpp@rank0` on the head and
the world re-forms by itself; a second playbook run changes nothing.

The stand-ins, for hardware and services this machine lacks: no GPU and no RDMA (those roles
report and skip); the weights are bind-mounted read-only into both containers where a real
cluster mounts the head's NFS export (a kernel NFS server does not run in a container, so
`dgpp_nfs_weights_enabled: false`); the containers have no route out, so no distribution
packages are installed and pip resolves dgpp's dependencies from the venv layer (`--no-index`).

    DGPP_NSPAWN=1 .venv/bin/python -m pytest tests/units/test_nspawn_cluster.py -s
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.units.cluster_net import ClusterNetwork
from tests.units.container import Container, missing_tools, stage_checkout
from tests.units.one_host import changed_tasks

pytestmark = pytest.mark.nspawn

MODEL = "/srv/models/SmolLM2-135M-Instruct"
HOSTS = ["spark-0", "spark-1"]
RENDEZVOUS_PORT = 29517
HEALTH = "curl -s http://127.0.0.1:18080/health"
CHAT = (
    "curl -s -w '\\n%{http_code}' http://127.0.0.1:18080/v1/chat/completions "
    "-H 'content-type: application/json' -d '"
    + json.dumps(
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
    )
    + "'"
)
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
TIMINGS: dict[str, float] = {}


@dataclass
class Cluster:
    network: ClusterNetwork
    boxes: dict[str, Container]
    inventory: Path

    @property
    def head(self) -> Container:
        return self.boxes[HOSTS[0]]

    @property
    def worker(self) -> Container:
        return self.boxes[HOSTS[1]]


def _inventory(network: ClusterNetwork, key: Path) -> dict[str, object]:
    site = {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(key),
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
        "ansible_python_interpreter": "/usr/bin/python3",
        "dgpp_install_packages": False,  # the containers have no route out
        "dgpp_nfs_weights_enabled": False,  # the weights are bind-mounted (see the docstring)
        "dgpp_host_wheel_build_args": ["--no-build-isolation"],
        "dgpp_host_pip_extra_args": "--no-index",
        "dgpp_head_address": network.address(HOSTS[0]),
        "dgpp_rendezvous_port": RENDEZVOUS_PORT,
        "dgpp_http_port": 18080,
        "dgpp_rdma_interface": "eth0",  # the bridge's veth: sockets only, no RDMA device
        "dgpp_engine_model": MODEL,
        "dgpp_engine_deployment": {
            "engine": {"kv_capacity": 2048, "num_threads": 1},
            "http": {"served_model_names": ["smollm2"]},
            "timeouts": {"heartbeat_s": 1.0, "control_deadline_s": 10.0},
        },
    }
    hosts = {
        name: {"ansible_host": network.address(name), "dgpp_rank": rank}
        for rank, name in enumerate(HOSTS)
    }
    head = {"hosts": {HOSTS[0]: hosts[HOSTS[0]]}}
    workers = {"hosts": {name: hosts[name] for name in HOSTS[1:]}}
    return {"all": {"vars": site, "children": {"head": head, "workers": workers}}}


def _with_sshd(box: Container, public_key: str) -> None:
    box.sh(
        "set -e; ssh-keygen -A >/dev/null; install -d -m 0700 /root/.ssh\n"
        f"printf '%s\\n' '{public_key}' > /root/.ssh/authorized_keys\n"
        "chmod 0600 /root/.ssh/authorized_keys; systemctl enable --now ssh.service >/dev/null 2>&1"
    )


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, default_checkpoint: Path
) -> Iterator[Cluster]:
    missing = missing_tools() + [
        tool for tool in ("ip", "ssh", "ssh-keygen") if not shutil.which(tool)
    ]
    missing += [] if ANSIBLE_PLAYBOOK.exists() else ["ansible-playbook"]
    if missing:
        pytest.skip("cannot boot the containers here, missing: " + ", ".join(missing))
    work = tmp_path_factory.mktemp("nspawn-cluster")
    checkout = stage_checkout(work / "src")  # the wheel is built in this copy, not the repo
    key = work / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    network = ClusterNetwork(HOSTS)
    boxes: dict[str, Container] = {}
    try:
        network.open()
        started = time.monotonic()
        for name in HOSTS:
            binds = {str(default_checkpoint): MODEL}
            boxes[name] = Container(work / name, binds, machine=name, netns=network.path(name))
            boxes[name].start()
            _with_sshd(boxes[name], key.with_suffix(".pub").read_text().strip())
        TIMINGS["boot both containers, sshd up"] = time.monotonic() - started
        inventory = checkout / "playbooks" / "inventory.json"
        inventory.write_text(json.dumps(_inventory(network, key), indent=2))
        yield Cluster(network, boxes, inventory)
    finally:
        for box in boxes.values():
            box.stop()
        network.close()
        print("\ntimings (s):", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def _playbook(cluster: Cluster, name: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0"}
    env |= {"ANSIBLE_HOST_KEY_CHECKING": "False", "ANSIBLE_FORCE_COLOR": "0"}
    command = [str(ANSIBLE_PLAYBOOK), "-i", str(cluster.inventory), "cluster.yml"]
    started = time.monotonic()
    result = subprocess.run(
        cluster.network.hub_command(command),
        cwd=cluster.inventory.parent,
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    TIMINGS[name] = time.monotonic() - started
    (cluster.inventory.parent / f"{name.replace(' ', '-')}.log").write_text(result.stdout)
    failures = [chunk for chunk in result.stdout.split("\n\n") if "fatal: [" in chunk]
    assert result.returncode == 0, "\n\n".join(failures)[-8000:] + result.stderr[-3000:]
    return result


def _status(box: Container, unit: str) -> str:
    return box.sh(f"systemctl show {unit} -p StatusText --value").stdout.strip()


def _journal(box: Container, unit: str) -> str:
    return box.sh(f"journalctl -u {unit} --no-pager -o cat").stdout[-4000:]


def _ready_lines(box: Container) -> int:
    return box.sh("journalctl -u dgpp@rank0 --no-pager -o cat").stdout.count("ready in")


def _joins(box: Container) -> int:
    journal = box.sh("journalctl -u dgpp@rank1 --no-pager -o cat").stdout
    return len(re.findall(r"rank 1 serving generation \d+", journal))


def _generation(box: Container) -> int:
    found = re.fullmatch(r"serving generation (\d+) as rank 1", _status(box, "dgpp@rank1"))
    assert found, (_status(box, "dgpp@rank1"), _journal(box, "dgpp@rank1"))
    return int(found.group(1))


def _serves_world_of_two(cluster: Cluster) -> None:
    health = json.loads(cluster.head.sh(HEALTH).stdout)
    assert health["world_size"] == 2, health
    body, status = cluster.head.sh(CHAT).stdout.rsplit("\n", 1)
    assert status == "200", body
    assert json.loads(body)["choices"][0]["message"]["content"].strip(), body


def test_the_playbook_brings_up_a_world_of_two_over_ssh(cluster: Cluster) -> None:
    result = _playbook(cluster, "first playbook run")
    print("\n" + "\n".join(re.findall(r"^\S+\s+: ok=.*$", result.stdout, re.MULTILINE)))
    _serves_world_of_two(cluster)
    assert _status(cluster.head, "dgpp@rank0").startswith("serving smollm2")
    assert _generation(cluster.worker) >= 1
    for box, unit in ((cluster.head, "dgpp@rank0"), (cluster.worker, "dgpp@rank1")):
        assert box.sh(f"systemctl is-enabled {unit} dgpp.target").returncode == 0
    assert "ready in" in _journal(cluster.head, "dgpp@rank0")
    for rank, box in enumerate((cluster.head, cluster.worker)):
        env = box.sh(f"cat /etc/dgpp/rank{rank}.env").stdout.splitlines()
        # dgpp_rdma's discovery, rendered by dgpp_engine; gloo formed the world over it
        assert {"NCCL_SOCKET_IFNAME=eth0", "GLOO_SOCKET_IFNAME=eth0"} <= set(env), env
        assert not any(line.startswith("NCCL_IB_") for line in env), env


def test_the_head_firewall_admits_the_worker_alone_to_the_rendezvous_port(
    cluster: Cluster,
) -> None:
    rules = cluster.head.sh("nft list table inet dgpp").stdout
    assert f"tcp dport {RENDEZVOUS_PORT}" in rules and cluster.network.address(HOSTS[1]) in rules
    head = cluster.network.address(HOSTS[0])
    probe = ["curl", "-s", "--connect-timeout", "3", f"telnet://{head}:{RENDEZVOUS_PORT}"]
    # From the bridge (not a cluster node) the SYN is dropped: curl times out (exit 28).
    outside = subprocess.run(cluster.network.hub_command(probe), capture_output=True, timeout=30)
    assert outside.returncode == 28, outside


def test_restarting_rank0_re_forms_the_world(cluster: Cluster) -> None:
    joined_before = _joins(cluster.worker)
    ready_before = _ready_lines(cluster.head)
    started = time.monotonic()
    # Type=notify: the restart returns once rank 0 serves again, which needs the worker back.
    # The new rank 0 numbers its worlds from 1 again: the worker's joins are what count.
    cluster.head.sh("systemctl restart dgpp@rank0", timeout_s=300)
    TIMINGS["systemctl restart dgpp@rank0 until serving"] = time.monotonic() - started
    _serves_world_of_two(cluster)
    assert _ready_lines(cluster.head) == ready_before + 1, _journal(cluster.head, "dgpp@rank0")
    assert _joins(cluster.worker) > joined_before, _journal(cluster.worker, "dgpp@rank1")
    # the worker rejoined in place: systemd did not have to restart it
    restarts = cluster.worker.sh("systemctl show dgpp@rank1 -p NRestarts --value").stdout
    assert restarts.strip() == "0", _journal(cluster.worker, "dgpp@rank1")


def test_a_second_playbook_run_changes_nothing(cluster: Cluster) -> None:
    result = _playbook(cluster, "second playbook run")
    changed = changed_tasks(result.stdout)
    assert changed == [], changed
    _serves_world_of_two(cluster)
