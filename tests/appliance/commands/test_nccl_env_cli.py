"""`dgpp nccl-env` over a recorded Spark (tests/appliance/doctor/fixtures/rdma)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgpp.appliance.cli import main

FIXTURES = Path(__file__).parents[1] / "doctor" / "fixtures" / "rdma"


def test_json_names_both_twins_and_stderr_reports_the_link(capsys: pytest.CaptureFixture[str]):
    root = FIXTURES / "spark_both_twins" / "root"
    assert main(["nccl-env", "--interface", "enp1s0f1np1", "--root", str(root), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_IB_HCA": "=rocep1s0f1:1,roceP2p1s0f1:1",
        "NCCL_SOCKET_IFNAME": "enp1s0f1np1",
    }
    assert "pass rdma.mtu: enp1s0f1np1 MTU 9000" in err.splitlines()


def test_lines_and_a_missing_interface(capsys: pytest.CaptureFixture[str]):
    root = FIXTURES / "spark_mtu_1024" / "root"
    assert main(["nccl-env", "--interface", "enp1s0f1np1", "--root", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "NCCL_IB_HCA==rocep1s0f1:1,roceP2p1s0f1:1" in out.splitlines()
    assert (
        "warn rdma.mtu: enp1s0f1np1 MTU 1500: a small MTU" in err
    )  # no tools off /: no active_mtu
    assert main(["nccl-env", "--interface", "eth9", "--root", str(root)]) == 2
    assert "no network interface 'eth9'" in capsys.readouterr().err
