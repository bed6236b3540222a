"""The RDMA ports behind a cluster interface, read from sysfs and `ibv_devinfo`.

A DGX Spark's ConnectX-7 shows each QSFP port as two RDMA devices, one per PCIe x4 link of the
GB10 ("twins": `rocep1s0f1` on PCI domain 0 and `roceP2p1s0f1` on domain 2, netdevs
`enp1s0f1np1` and `enP2p1s0f1np1`). The interface's own device is found through
`/sys/class/infiniband/<dev>/device/net/<if>` (or a port's `gid_attrs/ndevs`), its twins as the
devices at the same PCI bus, slot and function on another domain. For each port: state, link
layer, rate, the RoCE v2 GID index (an IPv4-mapped GID preferred) and `ibv_devinfo`'s
`active_mtu`; for the interface: MTU and speed from `/sys/class/net/<if>` (else `ip -j link`).

Everything is read through a probe whose readings are None for a file or tool that is missing or
unreadable; what could not be read is named in `LinkDiscovery.problems`, never raised.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

SYS_INFINIBAND = "/sys/class/infiniband"
SYS_NET = "/sys/class/net"
ROCE_V2 = "RoCE v2"
IPV4_MAPPED_PREFIX = "0000:0000:0000:0000:0000:ffff:"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
# systemd/rdma-core's path names: roce[P<domain>]p<bus>s<slot>[f<function>]
_PATH_NAME = re.compile(r"^[a-z]+(?:P(\d+))?p(\d+)s(\d+)(?:f(\d+))?")
_PCI_SLOT = re.compile(r"^PCI_SLOT_NAME=([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")
_STATE = re.compile(r"^\s*\d+\s*:\s*(\w+)")  # sysfs "4: ACTIVE"
_DEVINFO_FIELD = re.compile(r"^\s*(\w+):\s*(.*?)\s*$")


class Reading(Protocol):
    @property
    def text(self) -> str | None: ...  # None: nothing read, `reason` says why

    @property
    def reason(self) -> str: ...


class Probe(Protocol):
    """Reads a node (`dgpp.appliance.doctor.probe.Probe`): a file's text, the absolute paths a
    glob matches, a tool's standard output; a reading's text is None when the file or tool is
    missing, unreadable or fails."""

    def read(self, path: str) -> Reading: ...

    def glob(self, pattern: str) -> list[str]: ...

    def run(self, *argv: str, timeout_s: float | None = None) -> Reading: ...


def read_text(probe: Probe, path: str) -> str | None:
    return probe.read(path).text


def listdir(probe: Probe, folder: str) -> list[str]:
    """The names in `folder`, sorted; [] when it is absent."""
    return sorted(path.rsplit("/", 1)[-1] for path in probe.glob(f"{folder}/*"))


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str
    type: str  # "RoCE v2", "IB/RoCE v1"
    netdev: str | None

    @property
    def is_ipv4_mapped(self) -> bool:
        return self.gid.lower().startswith(IPV4_MAPPED_PREFIX)


@dataclass(frozen=True)
class RdmaPort:
    device: str  # "rocep1s0f1"
    port: int  # 1-based, as sysfs and NCCL number them
    state: str  # "ACTIVE", "DOWN", ...; "" when unreadable
    link_layer: str  # "Ethernet" (RoCE) or "InfiniBand"; "" when unreadable
    rate_gbps: float | None
    pci_slot: tuple[int, int, int, int] | None  # (domain, bus, slot, function)
    netdev: str | None  # the PCI function's network device ("enP2p1s0f1np1")
    gids: tuple[Gid, ...]
    active_mtu: int | None  # ibv_devinfo's, None without the tool

    @property
    def hca(self) -> str:
        return f"{self.device}:{self.port}"

    @property
    def is_active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def roce_v2_gid(self) -> Gid | None:
        """The GID NCCL should use: RoCE v2, IPv4-mapped first, then the lowest index."""
        candidates = [gid for gid in self.gids if gid.type == ROCE_V2]
        candidates.sort(key=lambda gid: (not gid.is_ipv4_mapped, gid.index))
        return candidates[0] if candidates else None


@dataclass(frozen=True)
class LinkDiscovery:
    interface: str
    num_devices: int  # RDMA devices on the node, behind this interface or not
    ports: tuple[RdmaPort, ...]  # the interface's own port first, then its twins (any state)
    netdev_mtu: int | None
    netdev_speed_gbps: float | None
    problems: tuple[str, ...]  # what could not be read, for `unknown` findings

    @property
    def own(self) -> RdmaPort | None:
        return self.ports[0] if self.ports else None

    @property
    def twins(self) -> tuple[RdmaPort, ...]:
        return self.ports[1:]

    @property
    def active_ports(self) -> tuple[RdmaPort, ...]:
        """The ports NCCL should use: ACTIVE, on the own port's link layer."""
        own = self.own
        if own is None:
            return ()
        return tuple(p for p in self.ports if p.is_active and p.link_layer == own.link_layer)

    @property
    def gid_index(self) -> int | None:
        for port in self.active_ports or self.ports[:1]:
            if (gid := port.roce_v2_gid) is not None:
                return gid.index
        return None

    @property
    def speed_gbps(self) -> float | None:
        """The link's speed: the netdev's, else the own port's RDMA rate."""
        if self.netdev_speed_gbps is not None:
            return self.netdev_speed_gbps
        return self.own.rate_gbps if self.own is not None else None


def parse_state(text: str | None) -> str:
    """sysfs `ports/<n>/state` ("4: ACTIVE") or ibv_devinfo's ("PORT_ACTIVE (4)") -> "ACTIVE"."""
    if not text:
        return ""
    if match := _STATE.match(text):
        return match.group(1).upper()
    word = text.strip().split(" ")[0].upper().removeprefix("PORT_")
    return word if word.isalpha() else ""


def parse_rate(text: str | None) -> float | None:
    """sysfs `ports/<n>/rate` ("200 Gb/sec (4X HDR)") -> 200.0."""
    match = _RATE.match(text or "")
    return float(match.group(1)) if match else None


def parse_int(text: str | None) -> int | None:
    try:
        return int((text or "").strip())
    except ValueError:
        return None


def parse_pci_slot(uevent: str | None, device: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, slot, function) from the PCI device's uevent, else from a path name."""
    for line in (uevent or "").splitlines():
        if match := _PCI_SLOT.match(line.strip()):
            return tuple(int(part, 16) for part in match.groups())  # type: ignore[return-value]
    if match := _PATH_NAME.match(device):
        domain, bus, slot, function = match.groups()
        return (int(domain or "0", 16), int(bus), int(slot), int(function or "0"))
    return None


def parse_ibv_devinfo(text: str | None) -> dict[tuple[str, int], dict[str, str]]:
    """`ibv_devinfo`'s report -> {(device, port): {"state", "active_mtu", "link_layer", ...}}."""
    ports: dict[tuple[str, int], dict[str, str]] = {}
    device: str | None = None
    fields: dict[str, str] | None = None
    for line in (text or "").splitlines():
        match = _DEVINFO_FIELD.match(line)
        if match is None:
            continue
        key, value = match.groups()
        if key == "hca_id":
            device, fields = value, None
        elif key == "port" and device is not None:
            if (number := parse_int(value)) is not None:
                fields = ports.setdefault((device, number), {})
        elif fields is not None:
            fields.setdefault(key, value)
    return ports


def parse_ip_link(text: str | None, interface: str) -> dict[str, object]:
    """`ip -j link`'s entry for `interface` ({} when absent or not JSON)."""
    try:
        links = json.loads(text or "")
    except ValueError:
        return {}
    if not isinstance(links, list):
        return {}
    for link in links:
        if isinstance(link, dict) and link.get("ifname") == interface:
            return link
    return {}


def _read_gids(probe: Probe, port_dir: str) -> tuple[Gid, ...]:
    gids = []
    for name in sorted(listdir(probe, f"{port_dir}/gids"), key=lambda n: parse_int(n) or 0):
        index = parse_int(name)
        gid = (read_text(probe, f"{port_dir}/gids/{name}") or "").strip().lower()
        if index is None or not gid or gid == ZERO_GID:
            continue
        gid_type = (read_text(probe, f"{port_dir}/gid_attrs/types/{name}") or "").strip()
        netdev = (read_text(probe, f"{port_dir}/gid_attrs/ndevs/{name}") or "").strip() or None
        gids.append(Gid(index, gid, gid_type, netdev))
    return tuple(gids)


def _read_port(
    probe: Probe, device: str, port: int, devinfo: dict[tuple[str, int], dict[str, str]]
) -> RdmaPort:
    port_dir = f"{SYS_INFINIBAND}/{device}/ports/{port}"
    tool = devinfo.get((device, port), {})
    state = parse_state(read_text(probe, f"{port_dir}/state")) or parse_state(tool.get("state"))
    link_layer = (
        read_text(probe, f"{port_dir}/link_layer") or tool.get("link_layer") or ""
    ).strip()
    active_mtu = parse_int((tool.get("active_mtu") or "").split(" ")[0])
    return RdmaPort(
        device=device,
        port=port,
        state=state,
        link_layer=link_layer,
        rate_gbps=parse_rate(read_text(probe, f"{port_dir}/rate")),
        pci_slot=parse_pci_slot(
            read_text(probe, f"{SYS_INFINIBAND}/{device}/device/uevent"), device
        ),
        netdev=next(iter(listdir(probe, f"{SYS_INFINIBAND}/{device}/device/net")), None),
        gids=_read_gids(probe, port_dir),
        active_mtu=active_mtu,
    )


def _port_numbers(probe: Probe, device: str) -> list[int]:
    names = listdir(probe, f"{SYS_INFINIBAND}/{device}/ports")
    return sorted(n for n in map(parse_int, names) if n is not None)


def _is_twin(port: RdmaPort, own: RdmaPort) -> bool:
    if port.device == own.device or port.pci_slot is None or own.pci_slot is None:
        return False
    same_function = port.pci_slot[1:] == own.pci_slot[1:] and port.pci_slot[0] != own.pci_slot[0]
    return same_function and port.port == own.port


def discover_link(probe: Probe, interface: str) -> LinkDiscovery:
    """The RDMA ports behind `interface` (its own first, then its twins) and its MTU and speed."""
    problems: list[str] = []
    devices = listdir(probe, SYS_INFINIBAND)
    if not devices:
        problems.append(f"{SYS_INFINIBAND} is empty or absent")
    devinfo = parse_ibv_devinfo(probe.run("ibv_devinfo").text) if devices else {}
    ports = [
        _read_port(probe, device, number, devinfo)
        for device in devices
        for number in _port_numbers(probe, device)
    ]
    own = _own_port(probe, interface, ports)
    found = (own, *(p for p in ports if _is_twin(p, own))) if own is not None else ()
    if devices and own is None:
        problems.append(f"no RDMA device has {interface} as its network device")

    mtu = parse_int(read_text(probe, f"{SYS_NET}/{interface}/mtu"))
    if mtu is None:  # no sysfs at this root: ask ip(8)
        link = probe.run("ip", "-j", "link", "show", "dev", interface).text
        link_mtu = parse_ip_link(link, interface).get("mtu")
        mtu = link_mtu if isinstance(link_mtu, int) and not isinstance(link_mtu, bool) else None
    if mtu is None:
        problems.append(f"{interface}'s MTU is unreadable ({SYS_NET}/{interface}/mtu, ip -j link)")
    speed_mbps = parse_int(read_text(probe, f"{SYS_NET}/{interface}/speed"))
    speed = speed_mbps / 1000 if speed_mbps is not None and speed_mbps > 0 else None
    return LinkDiscovery(interface, len(devices), found, mtu, speed, tuple(problems))


def _own_port(probe: Probe, interface: str, ports: list[RdmaPort]) -> RdmaPort | None:
    """The port whose network device is `interface`: a RoCE GID on it, else the device's net/."""
    for port in ports:
        if any(gid.netdev == interface for gid in port.gids):
            return port
    for port in ports:
        if interface in (listdir(probe, f"{SYS_INFINIBAND}/{port.device}/device/net")):
            return port
    return None


def guess_interface(probe: Probe) -> str | None:
    """The network device of the first ACTIVE RDMA port (for a doctor run given no interface)."""
    for device in listdir(probe, SYS_INFINIBAND):
        for number in _port_numbers(probe, device):
            state = parse_state(read_text(probe, f"{SYS_INFINIBAND}/{device}/ports/{number}/state"))
            netdevs = listdir(probe, f"{SYS_INFINIBAND}/{device}/device/net")
            if state == "ACTIVE" and netdevs:
                return sorted(netdevs)[0]
    return None
