"""NCCL's environment for a cluster link, and the doctor's findings about that link.

`nccl_env` turns a `LinkDiscovery` into the variables the playbook renders into every rank's
environment file (`dgpp nccl-env`); `rdma_checks` says whether the link can reach its full rate:
both twins ACTIVE and named in `NCCL_IB_HCA`, a RoCE v2 GID index, a 9000-byte MTU, 200 Gb/s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dgpp.appliance.doctor.check import Check
from dgpp.appliance.doctor.rdma_discovery import (
    ROCE_V2,
    SYS_INFINIBAND,
    LinkDiscovery,
    Probe,
    RdmaPort,
    discover_link,
    guess_interface,
    listdir,
    parse_int,
    read_text,
)

FULL_RATE_GBPS = 200.0  # a DGX Spark's QSFP port, both twins together
JUMBO_MTU = 9000  # the netdev MTU that gives RoCE its 4096-byte active MTU
ROCE_MAX_MTU = 4096
RANK_ENV_DIR = "/etc/dgpp"  # the playbook's rankN.env files
MTU_FIX = (
    "set dgpp_rdma_mtu_interface: {interface} (dgpp_rdma_mtu: 9000) in the inventory and rerun "
    "the playbook (now: ip link set dev {interface} mtu 9000); the peer needs the same MTU"
)


def nccl_env(discovery: LinkDiscovery) -> dict[str, str]:
    """NCCL's and Gloo's variables for the link: sockets on the interface; with ACTIVE RDMA ports,
    every one of them in `NCCL_IB_HCA` (exact `=device:port` names, as NCCL's docs write them:
    a name without `=` is a prefix) and the RoCE v2 GID index."""
    env = {"NCCL_SOCKET_IFNAME": discovery.interface, "GLOO_SOCKET_IFNAME": discovery.interface}
    ports = discovery.active_ports
    if ports:
        env["NCCL_IB_HCA"] = "=" + ",".join(port.hca for port in ports)
        if ports[0].link_layer == "Ethernet" and discovery.gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(discovery.gid_index)
    return env


def hca_selects(value: str, port: RdmaPort) -> bool:
    """Whether an `NCCL_IB_HCA` value lets NCCL use `port` (prefix, `=` exact, `^` exclude)."""
    spec = value.strip()
    exclude = spec.startswith("^")
    spec = spec.removeprefix("^")
    exact = spec.startswith("=")
    spec = spec.removeprefix("=")
    named = False
    for token in spec.split(","):
        name, _, number = token.strip().partition(":")
        if not name:
            continue
        name_matches = port.device == name if exact else port.device.startswith(name)
        named |= name_matches and (not number or parse_int(number) == port.port)
    return not named if exclude else named


def configured(probe: Probe, environ: Mapping[str, str], name: str) -> list[tuple[str, str]]:
    """(value, where) of `name` in this process's environment and in every rank's env file."""
    found = [(environ[name], "the environment")] if environ.get(name) else []
    for file in listdir(probe, RANK_ENV_DIR):
        if not (file.startswith("rank") and file.endswith(".env")):
            continue
        for line in (read_text(probe, f"{RANK_ENV_DIR}/{file}") or "").splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key == name and value:
                found.append((value, f"{RANK_ENV_DIR}/{file}"))
    return found


def rdma_checks(
    probe: Probe, interface: str | None = None, environ: Mapping[str, str] | None = None
) -> list[Check]:
    """The link's findings; `interface` defaults to a rank file's `NCCL_SOCKET_IFNAME`, else to
    the network device of the first ACTIVE RDMA port."""
    environ = os.environ if environ is None else environ
    try:
        return _checks(probe, interface, environ)
    except Exception as err:  # a check reports, it never takes the doctor down
        return [Check("rdma.devices", "unknown", f"reading the RDMA devices failed: {err!r}")]


def _checks(probe: Probe, interface: str | None, environ: Mapping[str, str]) -> list[Check]:
    if not listdir(probe, SYS_INFINIBAND):
        detail = (
            "no RDMA devices (/sys/class/infiniband is empty or absent); a single node needs none"
        )
        return [Check("rdma.devices", "unknown", detail)]
    if not interface:
        named = configured(probe, environ, "NCCL_SOCKET_IFNAME")
        interface = named[0][0].lstrip("=^").split(",")[0] if named else guess_interface(probe)
    if not interface:
        detail = "RDMA devices but none ACTIVE with a network device, and no interface named"
        return [Check("rdma.devices", "unknown", detail, "name the cluster interface")]
    discovery = discover_link(probe, interface)
    if discovery.own is None:
        detail = f"{interface} has no RDMA device: NCCL would carry the world over TCP sockets"
        fix = "name the ConnectX link's interface (dgpp_rdma_interface) in the inventory"
        return [Check("rdma.devices", "warn", detail, fix), _mtu(discovery), _speed(discovery)]
    return [
        _twins(discovery),
        _hca(discovery, configured(probe, environ, "NCCL_IB_HCA")),
        _gid(discovery, configured(probe, environ, "NCCL_IB_GID_INDEX")),
        _mtu(discovery),
        _speed(discovery),
    ]


def _names(ports: tuple[RdmaPort, ...]) -> str:
    return ", ".join(f"{port.hca} {port.state or 'state unknown'}" for port in ports)


def _twins(discovery: LinkDiscovery) -> Check:
    interface, own, twins = discovery.interface, discovery.own, discovery.twins
    assert own is not None
    if not own.is_active:
        detail = f"{interface}'s RDMA port is not ACTIVE ({_names(discovery.ports)})"
        return Check(
            "rdma.twins", "warn", detail, f"check the cable and the peer; ip link show {interface}"
        )
    if not twins:
        detail = f"{own.hca} ACTIVE behind {interface}, no twin on another PCIe domain"
        return Check("rdma.twins", "pass", detail)
    down = [twin for twin in twins if twin not in discovery.active_ports]
    if down:
        detail = f"one twin in use behind {interface} ({_names(discovery.ports)})"
        netdevs = " and ".join(t.netdev or f"{t.device}'s network device" for t in down)
        fix = f"bring up {netdevs} with an address on the cluster subnet; NCCL_IB_HCA needs both"
        return Check("rdma.twins", "warn", f"{detail}: ~112 Gb/s instead of 200", fix)
    return Check(
        "rdma.twins", "pass", f"both twins ACTIVE behind {interface}: {_names(discovery.ports)}"
    )


def _hca(discovery: LinkDiscovery, settings: list[tuple[str, str]]) -> Check:
    wanted = nccl_env(discovery).get("NCCL_IB_HCA", "")
    if not settings:
        detail = f"NCCL_IB_HCA unset: NCCL picks the devices itself (this link: {wanted})"
        return Check("rdma.nccl_hca", "pass", detail)
    for value, where in settings:
        missing = [p.hca for p in discovery.active_ports if not hca_selects(value, p)]
        if missing:
            detail = (
                f"NCCL_IB_HCA={value} in {where} leaves out {', '.join(missing)}: "
                "~112 Gb/s instead of 200"
            )
            fix = f"put both twins in NCCL_IB_HCA: {wanted} (dgpp_rdma_nccl_env, or unset it)"
            return Check("rdma.nccl_hca", "warn", detail, fix)
    sources = ", ".join(where for _, where in settings)
    return Check("rdma.nccl_hca", "pass", f"NCCL_IB_HCA names every ACTIVE port ({sources})")


def _gid(discovery: LinkDiscovery, settings: list[tuple[str, str]]) -> Check:
    own = discovery.own
    assert own is not None
    if own.link_layer == "InfiniBand":
        return Check("rdma.gid", "pass", f"{own.hca} is InfiniBand: no GID index to choose")
    fix = f"give {discovery.interface} its IPv4 address (a RoCE v2 GID follows it)"
    index = discovery.gid_index
    if index is None:
        detail = f"no RoCE v2 GID on {discovery.interface}'s ports ({_names(discovery.ports)})"
        return Check("rdma.gid", "warn", detail, fix)
    for port in discovery.active_ports:
        gid = next((g for g in port.gids if g.index == index), None)
        if gid is None or gid.type != ROCE_V2:
            kind = gid.type if gid is not None else "empty"
            detail = f"GID {index} is RoCE v2 on {discovery.own.hca} but {kind} on {port.hca}"
            return Check(
                "rdma.gid", "warn", detail, f"give {port.device}'s network device its IPv4 address"
            )
    for value, where in settings:
        chosen = parse_int(value)
        gid = next((g for g in own.gids if g.index == chosen), None)
        if gid is None or gid.type != ROCE_V2:
            kind = gid.type if gid is not None else "no GID"
            detail = (
                f"NCCL_IB_GID_INDEX={value} in {where} is {kind}, not RoCE v2 (that is {index})"
            )
            return Check("rdma.gid", "warn", detail, f"set NCCL_IB_GID_INDEX={index} or unset it")
    return Check("rdma.gid", "pass", f"NCCL_IB_GID_INDEX {index} is RoCE v2 on every ACTIVE port")


def _mtu(discovery: LinkDiscovery) -> Check:
    interface, mtu = discovery.interface, discovery.netdev_mtu
    active = {p.active_mtu for p in discovery.active_ports if p.active_mtu is not None}
    if mtu is None and not active:
        return Check("rdma.mtu", "unknown", "; ".join(discovery.problems) or "MTU unreadable")
    parts = [f"{interface} MTU {mtu if mtu is not None else 'unknown'}"]
    if active:
        parts.append(f"RoCE active_mtu {'/'.join(map(str, sorted(active)))}")
    detail = ", ".join(parts)
    if (mtu is not None and mtu < JUMBO_MTU) or (active and min(active) < ROCE_MAX_MTU):
        detail += ": a small MTU is suspected of costing ~40% of multi-node prefill"
        return Check("rdma.mtu", "warn", detail, MTU_FIX.format(interface=interface))
    return Check("rdma.mtu", "pass", detail)


def _speed(discovery: LinkDiscovery) -> Check:
    speed = discovery.speed_gbps
    if speed is None:
        return Check("rdma.speed", "unknown", f"{discovery.interface}'s speed is unreadable")
    detail = f"{discovery.interface} links at {speed:g} Gb/s"
    if speed < FULL_RATE_GBPS:
        fix = f"check the cable (200G QSFP112) and the peer's port: ethtool {discovery.interface}"
        return Check("rdma.speed", "warn", f"{detail}, below {FULL_RATE_GBPS:g}", fix)
    return Check("rdma.speed", "pass", detail)
