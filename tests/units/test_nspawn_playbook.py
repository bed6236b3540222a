"""`playbooks/cluster.yml` run for real into a booted container (see `container.py`) as a
one-host cluster: Ansible on this host reaches the container's namespaces through the
`community.docker.nsenter` connection, and the container's own systemd runs what the roles
install. The stand-ins: no GPU and no RDMA here (those roles report and skip), no network in
the container (so no distribution packages are installed, and pip resolves dgpp's
dependencies from the venv layer with `--no-index`).

    DGPP_NSPAWN=1 /tmp/venv/bin/python -m pytest tests/units/test_nspawn_playbook.py -s
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.units.container import Container, missing_tools, stage_checkout

pytestmark = pytest.mark.nspawn

MODEL = "/srv/models/SmolLM2-135M-Instruct"
HEALTH = "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:18080/health"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def _inventory(leader: int) -> dict[str, object]:
    site = {
        "dgpp_install_packages": False,  # the container has no network
        "dgpp_host_wheel_build_args": ["--no-build-isolation"],
        "dgpp_host_pip_extra_args": "--no-index",
        "dgpp_engine_model": MODEL,
        "dgpp_engine_deployment": {
            "engine": {"kv_capacity": 2048, "num_threads": 2},
            "http": {"served_model_names": ["smollm2"]},
        },
        "dgpp_http_port": 18080,
    }
    host = {
        "ansible_connection": "community.docker.nsenter",
        "ansible_nsenter_pid": leader,
        "ansible_python_interpreter": "/usr/bin/python3",
        "ansible_host": "127.0.0.1",
        "dgpp_rank": 0,
    }
    head = {"hosts": {"spark-0": host}}
    return {"all": {"vars": site, "children": {"head": head, "workers": {"hosts": {}}}}}


@pytest.fixture(scope="module")
def deployed(
    tmp_path_factory: pytest.TempPathFactory, default_checkpoint: Path
) -> Iterator[tuple[Container, Path]]:
    missing = missing_tools() + ([] if ANSIBLE_PLAYBOOK.exists() else ["ansible-playbook"])
    if missing:
        pytest.skip("cannot boot a container here, missing: " + ", ".join(missing))
    work = tmp_path_factory.mktemp("nspawn-playbook")
    checkout = stage_checkout(work / "src")  # the wheel is built in this copy, not the repo
    if not (checkout / "playbooks/cluster.yml").exists():
        pytest.skip("playbooks/cluster.yml is not in this checkout")
    box = Container(work / "container", {str(default_checkpoint): MODEL})
    try:
        box.start()
        inventory = work / "inventory.json"
        inventory.write_text(json.dumps(_inventory(box.leader or 0)))
        yield box, inventory
    finally:
        box.stop()


def _playbook(inventory: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0"}
    started = time.monotonic()
    result = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), "cluster.yml"],
        cwd=inventory.parent / "src" / "playbooks",
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    return result, time.monotonic() - started


def _changed_tasks(output: str) -> list[str]:
    tasks, task = [], ""
    for line in output.splitlines():
        if line.startswith(("TASK [", "RUNNING HANDLER [")):
            task = line.rstrip(" *")
        elif line.startswith("changed:"):
            tasks.append(task)
    return tasks


def test_cluster_playbook_brings_up_a_serving_rank(deployed: tuple[Container, Path]) -> None:
    box, inventory = deployed
    result, seconds = _playbook(inventory)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    print(f"\nfirst run: {seconds:.1f} s; {re.findall(r'ok=.*', result.stdout)}")
    assert box.sh(HEALTH).stdout == "200"
    status = box.sh("systemctl show dgpp@rank0 -p ActiveState -p StatusText").stdout
    assert "ActiveState=active" in status and "StatusText=serving smollm2" in status, status
    assert box.sh("systemctl is-enabled dgpp@rank0 dgpp.target dgpp-tune").returncode == 0
    journal = box.sh("journalctl -u dgpp@rank0 --no-pager -o cat").stdout
    assert "ready in" in journal


def test_a_second_run_changes_nothing(deployed: tuple[Container, Path]) -> None:
    box, inventory = deployed
    result, seconds = _playbook(inventory)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    changed = _changed_tasks(result.stdout)
    print(f"\nsecond run: {seconds:.1f} s; changed: {changed}")
    assert box.sh(HEALTH).stdout == "200"
    assert changed == []
