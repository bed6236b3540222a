"""playbooks/doctor.yml on a staged host (see staging.py): `dgpp doctor --json` reads the host's
files under its root, the play prints the findings, warns and fails on a failure only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.playbooks.staging import BIN, RocePort, StagedHost, run_playbook, stage, write_inventory

pytestmark = pytest.mark.skipif(
    shutil.which("ansible-playbook", path=str(BIN)) is None,
    reason="ansible is not installed (pip install -e '.[test]')",
)


def test_a_warning_is_reported_and_does_not_fail_the_play(tmp_path: Path):
    host = StagedHost(
        "host0",
        0,
        tmp_path / "host0",
        tmp_path / "stand-in",
        roce_ports={
            "rocep1s0f1/1": RocePort("enp1s0f1np1"),
            "roceP2p1s0f1/1": RocePort("enP2p1s0f1np1", state="1: DOWN"),
        },
        host_vars={"dgpp_rdma_interface": "enp1s0f1np1"},
    )
    stage(host)
    inventory = write_inventory(tmp_path / "inventory.yml", host, [])
    run = run_playbook(inventory, tmp_path / "ansible", playbook="doctor.yml")
    assert run.returncode == 0, run.output
    assert "pass rdma.mtu enp1s0f1np1 MTU 9000" in run.output
    assert "WARNING: host0 warn rdma.twins: one twin in use behind enp1s0f1np1" in run.output
    assert "fix: bring up enP2p1s0f1np1" in run.output
