"""RDMA discovery, NCCL's environment and the link's findings over recorded Spark nodes
(fixtures/rdma/README.md): both twins ACTIVE, a single twin, an MTU of 1024; unreadable or
garbled input gives `unknown`, never an exception."""

from __future__ import annotations

import shutil
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.appliance.doctor.check import Check, exit_code
from dgpp.appliance.doctor.probe import Probe, Reading
from dgpp.appliance.doctor.rdma import hca_selects, nccl_env, rdma_checks
from dgpp.appliance.doctor.rdma_discovery import (
    discover_link,
    parse_ibv_devinfo,
    parse_ip_link,
    parse_pci_slot,
    parse_rate,
    parse_state,
)

FIXTURES = Path(__file__).parent / "fixtures" / "rdma"
BOTH = "=rocep1s0f1:1,roceP2p1s0f1:1"


class RecordedProbe(Probe):
    """A node recorded in a fixture folder: files under `root/`, tools' output beside it."""

    def __init__(self, case: Path) -> None:
        super().__init__(case / "root", env={"PATH": ""})
        self.case = case

    def run(self, *argv: str, timeout_s: float | None = None) -> Reading:
        recorded = {"ibv_devinfo": "ibv_devinfo.txt", "ip": "ip-link.json"}.get(argv[0])
        path = self.case / recorded if recorded else None
        if path is None or not path.exists():
            return Reading(None, f"{argv[0]} not found")
        return Reading(path.read_text())


def probe(name: str) -> RecordedProbe:
    return RecordedProbe(FIXTURES / name)


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def test_both_twins_give_both_in_nccl_ib_hca_and_the_roce_v2_gid():
    discovery = discover_link(probe("spark_both_twins"), "enp1s0f1np1")
    assert [port.hca for port in discovery.ports] == ["rocep1s0f1:1", "roceP2p1s0f1:1"]
    assert discovery.netdev_mtu == 9000 and discovery.speed_gbps == 200
    assert [port.active_mtu for port in discovery.ports] == [4096, 4096]
    assert nccl_env(discovery) == {
        "NCCL_IB_HCA": BOTH,
        "NCCL_IB_GID_INDEX": "3",  # RoCE v2 and IPv4-mapped; 1 is RoCE v2 link-local
        "NCCL_SOCKET_IFNAME": "enp1s0f1np1",
        "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
    }
    checks = rdma_checks(probe("spark_both_twins"), "enp1s0f1np1", environ={})
    assert {c.name: c.status for c in checks} == {
        "rdma.twins": "pass",
        "rdma.nccl_hca": "pass",  # the rank file names both
        "rdma.gid": "pass",
        "rdma.mtu": "pass",
        "rdma.speed": "pass",
    }
    assert exit_code(checks) == 0


def test_the_interface_comes_from_the_rank_file_when_none_is_named():
    checks = by_name(rdma_checks(probe("spark_both_twins"), None, environ={}))
    assert "enp1s0f1np1" in checks["rdma.twins"].detail


def test_an_nccl_ib_hca_naming_one_twin_warns():
    def hca(value: str) -> Check:
        checks = rdma_checks(probe("spark_both_twins"), "enp1s0f1np1", {"NCCL_IB_HCA": value})
        return by_name(checks)["rdma.nccl_hca"]

    assert hca("roce").status == "pass"  # a prefix of both twins
    for value in ("rocep1", "=rocep1s0f1:1", "^roceP2"):  # a prefix is case-sensitive
        assert hca(value).status == "warn", value
        assert "roceP2p1s0f1:1" in hca(value).detail and "~112 Gb/s" in hca(value).detail
    assert BOTH in hca("rocep1").fix


def test_a_gid_index_that_is_not_roce_v2_warns():
    checks = by_name(
        rdma_checks(probe("spark_both_twins"), "enp1s0f1np1", {"NCCL_IB_GID_INDEX": "2"})
    )
    assert checks["rdma.gid"].status == "warn"
    assert "IB/RoCE v1" in checks["rdma.gid"].detail and "=3" in checks["rdma.gid"].fix


def test_a_single_twin_warns_and_nccl_gets_the_active_one():
    discovery = discover_link(probe("spark_single_twin"), "enp1s0f1np1")
    assert [(p.hca, p.state) for p in discovery.ports] == [
        ("rocep1s0f1:1", "ACTIVE"),
        ("roceP2p1s0f1:1", "DOWN"),
    ]
    assert nccl_env(discovery)["NCCL_IB_HCA"] == "=rocep1s0f1:1"
    checks = rdma_checks(probe("spark_single_twin"), "enp1s0f1np1", environ={})
    twins = by_name(checks)["rdma.twins"]
    assert twins.status == "warn" and "~112 Gb/s instead of 200" in twins.detail
    assert "enP2p1s0f1np1" in twins.fix
    assert exit_code(checks) == 1


def test_an_mtu_of_1024_warns_with_the_playbook_fix():
    checks = by_name(rdma_checks(probe("spark_mtu_1024"), "enp1s0f1np1", environ={}))
    mtu = checks["rdma.mtu"]
    assert mtu.status == "warn"
    assert "MTU 1500" in mtu.detail and "active_mtu 1024" in mtu.detail
    assert "dgpp_rdma_mtu_interface: enp1s0f1np1" in mtu.fix
    assert checks["rdma.twins"].status == "pass"


def test_a_slow_link_warns(tmp_path: Path):
    case = tmp_path / "slow"
    shutil.copytree(FIXTURES / "spark_both_twins", case)
    (case / "root/sys/class/net/enp1s0f1np1/speed").write_text("100000\n")
    speed = by_name(rdma_checks(RecordedProbe(case), "enp1s0f1np1", environ={}))["rdma.speed"]
    assert speed.status == "warn" and "100 Gb/s" in speed.detail


def test_a_node_without_rdma_is_unknown(tmp_path: Path):
    checks = rdma_checks(Probe(tmp_path, env={"PATH": ""}), "eth0", environ={})
    assert [(c.name, c.status) for c in checks] == [("rdma.devices", "unknown")]
    assert nccl_env(discover_link(Probe(tmp_path), "eth0")) == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }


def test_an_interface_without_rdma_warns():
    checks = by_name(rdma_checks(probe("spark_both_twins"), "enP7s7", environ={}))
    assert checks["rdma.devices"].status == "warn"
    assert checks["rdma.mtu"].status == "warn"  # read from `ip -j link`: 1500


def test_garbled_files_and_tools_give_unknown_not_an_exception(tmp_path: Path):
    case = tmp_path / "garbled"
    shutil.copytree(FIXTURES / "spark_both_twins", case)
    for path in (case / "root/sys").rglob("*"):
        if path.is_file():
            path.write_bytes(b"\xff\x00 garbage: n/a\n")
    (case / "ibv_devinfo.txt").write_text("hca_id:\nport: x\n\tactive_mtu: lots\n")
    (case / "ip-link.json").write_text("{not json")
    checks = rdma_checks(RecordedProbe(case), "enp1s0f1np1", environ={})
    assert all(isinstance(check, Check) for check in checks)
    assert by_name(checks)["rdma.mtu"].status == "unknown"
    assert by_name(checks)["rdma.speed"].status == "unknown"


def test_parsers_read_the_documented_formats():
    assert parse_state("4: ACTIVE\n") == "ACTIVE" and parse_state("PORT_DOWN (1)") == "DOWN"
    assert parse_rate("200 Gb/sec (4X HDR)\n") == 200.0
    assert parse_pci_slot("PCI_SLOT_NAME=0002:01:00.1\n", "x") == (2, 1, 0, 1)
    assert parse_pci_slot(None, "roceP2p1s0f1") == (2, 1, 0, 1)
    assert parse_pci_slot(None, "mlx5_0") is None
    assert hca_selects(
        "^=rocep1s0f1", discover_link(probe("spark_both_twins"), "enp1s0f1np1").ports[1]
    )


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parsers_take_any_text(text: str):
    parse_state(text)
    parse_rate(text)
    parse_pci_slot(text, text)
    parse_ibv_devinfo(text)
    parse_ip_link(text, "eth0")
    hca_selects(text, discover_link(probe("spark_both_twins"), "enp1s0f1np1").ports[0])
