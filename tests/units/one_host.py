"""`playbooks/cluster.yml` run for real into a booted container (see `container.py`) as a
one-host cluster: Ansible on this host reaches the container's namespaces through the
`community.docker.nsenter` connection, and the container's own systemd runs what the roles
install (`test_nspawn_webui.py`). The stand-ins: no GPU and no RDMA here (those roles report and
skip), no network in the container (so no distribution packages are installed, and pip resolves
dgpp's dependencies from the venv layer with `--no-index`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

MODEL = "/srv/models/SmolLM2-135M-Instruct"
HEALTH = "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:18080/health"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def one_host_inventory(leader: int) -> dict[str, object]:
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


def run_playbook(inventory: Path) -> tuple[subprocess.CompletedProcess[str], float]:
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


def changed_tasks(output: str) -> list[str]:
    tasks, task = [], ""
    for line in output.splitlines():
        if line.startswith(("TASK [", "RUNNING HANDLER [")):
            task = line.rstrip(" *")
        elif line.startswith("changed:"):
            tasks.append(task)
    return tasks
