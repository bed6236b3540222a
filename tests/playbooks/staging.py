"""Staged cluster hosts on this machine for real runs of playbooks/cluster.yml.

Every host is `ansible_connection: local` with its own `dgpp_root`, so the roles write their
files under `<tmp>/<host>/...` instead of `/`. What a real node would have is staged there: an
fstab, cpufreq files under `sys/`, and `/opt/dgpp/venv` as a link to this interpreter's
environment (which has dgpp, so the head's deployment is validated by the real
`dgpp deploy validate`). This machine has no GPU: `nvidia-smi` is a *stand-in*, a small script
that appends its arguments to a log and answers the clock query with values the test chooses. It
lives outside the host's root, so a `--check` run that queries it leaves the root untouched.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"
BIN = Path(sys.executable).parent
# The modules run under the system's Python, as on a real node (Ansible finds /usr/bin/python3
# there); this venv's interpreter starts slower (its .pth files and site-packages), which cost
# ~14% of a cluster run's wall time. Any Python runs them: the venv's where there is no other.
MODULE_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").is_file() else sys.executable
RECAP = re.compile(
    r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
    r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)",
    re.MULTILINE,
)

NVIDIA_SMI_STAND_IN = """#!/bin/sh
# Stand-in for nvidia-smi: this machine has no GPU. Records every call and answers the clock
# query (--query-gpu=...) with the lines of clocks.csv beside it.
here=$(dirname "$0")
printf '%s\\n' "$*" >>"$here/calls.log"
case "$1" in
    --query-gpu=*) cat "$here/clocks.csv" ;;
    -L) echo "GPU 0: stand-in (UUID: GPU-00000000)" ;;
esac
"""

IP_STAND_IN = """#!/bin/sh
# Stand-in for ip(8): records every call; `ip link set dev IF mtu N` sets the staged sysfs MTU,
# as the kernel would.
printf '%s\\n' "$*" >>"$(dirname "$0")/ip-calls.log"
if [ "$1 $2 $3" = "link set dev" ] && [ "$5" = mtu ]; then
    printf '%s\\n' "$6" >"{sysfs}/sys/class/net/$4/mtu"
fi
"""


@dataclass
class Cpu:
    """One CPU's cpufreq files, as the kernel shows them."""

    governor: str = "powersave"
    max_freq_khz: int = 3_000_000
    cpuinfo_max_freq_khz: int = 3_900_000
    available: str = "performance powersave schedutil"


@dataclass
class RocePort:
    """A RoCE port as sysfs shows it: state, network device and, when ACTIVE, the GIDs of one
    IPv4 address (0/1 link-local v1/v2, 2/3 IPv4-mapped v1/v2)."""

    netdev: str
    state: str = "4: ACTIVE"
    ipv4: str = "0a0a:0001"  # the low 32 bits of the IPv4-mapped GID (10.10.0.1)


@dataclass
class StagedHost:
    name: str
    rank: int
    root: Path
    stand_in: Path  # the nvidia-smi stand-in's folder
    clocks_csv: str = "2418, 300, 2418\n"
    cpus: list[Cpu] = field(default_factory=list)  # empty: no cpufreq on this host
    rdma_ports: dict[str, str] = field(default_factory=dict)  # "device/port" -> state
    roce_ports: dict[str, RocePort] = field(default_factory=dict)  # "device/port" -> port
    interfaces: dict[str, int] = field(default_factory=dict)  # name -> MTU
    host_vars: dict[str, object] = field(default_factory=dict)

    @property
    def nvidia_smi(self) -> Path:
        return self.stand_in / "nvidia-smi"

    @property
    def ip(self) -> Path:
        return self.stand_in / "ip"

    def nvidia_smi_calls(self) -> list[str]:
        return self._calls("calls.log")

    def ip_calls(self) -> list[str]:
        return self._calls("ip-calls.log")

    def _calls(self, name: str) -> list[str]:
        log = self.stand_in / name
        return log.read_text().splitlines() if log.exists() else []

    def path(self, absolute: str) -> Path:
        """Where `absolute` on the real host lies in this staged root."""
        return self.root / absolute.lstrip("/")


def stage(host: StagedHost, venv_link: bool = True) -> None:
    """Lay out what a fresh Debian node has before the playbook runs; `venv_link` stands this
    interpreter's environment in for /opt/dgpp/venv (false: no venv at all)."""
    host.root.mkdir(parents=True)
    host.path("/etc/fstab").parent.mkdir(parents=True)
    host.path("/etc/fstab").write_text(
        "# <file system> <mount point> <type> <options> <dump> <pass>\n"
    )
    venv = host.path("/opt/dgpp/venv")
    venv.parent.mkdir(parents=True)
    if venv_link:
        venv.symlink_to(sys.prefix, target_is_directory=True)
    cpu_dir = host.path("/sys/devices/system/cpu")
    cpu_dir.mkdir(parents=True)
    (cpu_dir / "cpu0").mkdir()  # a CPU without cpufreq still has its folder
    for index, cpu in enumerate(host.cpus):
        cpufreq = cpu_dir / f"cpu{index}" / "cpufreq"
        cpufreq.mkdir(parents=True)
        (cpufreq / "scaling_governor").write_text(cpu.governor + "\n")
        (cpufreq / "scaling_max_freq").write_text(f"{cpu.max_freq_khz}\n")
        (cpufreq / "cpuinfo_max_freq").write_text(f"{cpu.cpuinfo_max_freq_khz}\n")
        (cpufreq / "scaling_available_governors").write_text(cpu.available + "\n")
    for port, state in host.rdma_ports.items():
        folder = host.path(f"/sys/class/infiniband/{port.replace('/', '/ports/')}")
        folder.mkdir(parents=True)
        (folder / "state").write_text(state + "\n")
        (folder / "rate").write_text("200 Gb/sec (4X HDR)\n")
    for port, roce in host.roce_ports.items():
        _stage_roce_port(host, port, roce)
    for name, mtu in host.interfaces.items():
        host.path(f"/sys/class/net/{name}").mkdir(parents=True, exist_ok=True)
        host.path(f"/sys/class/net/{name}/mtu").write_text(f"{mtu}\n")
    host.stand_in.mkdir(parents=True)
    host.nvidia_smi.write_text(NVIDIA_SMI_STAND_IN)
    host.ip.write_text(IP_STAND_IN.replace("{sysfs}", str(host.root)))
    for program in (host.nvidia_smi, host.ip):
        program.chmod(0o755)
    (host.stand_in / "clocks.csv").write_text(host.clocks_csv)


def _stage_roce_port(host: StagedHost, port: str, roce: RocePort) -> None:
    device, number = port.split("/")
    folder = host.path(f"/sys/class/infiniband/{device}/ports/{number}")
    active = roce.state.endswith("ACTIVE")
    files = {"state": roce.state, "rate": "200 Gb/sec (4X HDR)", "link_layer": "Ethernet"}
    link_local = "fe80:0000:0000:0000:4ebb:58ff:fe6a:1c21"
    mapped = f"0000:0000:0000:0000:0000:ffff:{roce.ipv4}"
    gids = [(link_local, "IB/RoCE v1"), (link_local, "RoCE v2")]
    gids += [(mapped, "IB/RoCE v1"), (mapped, "RoCE v2")]
    for index, (gid, kind) in enumerate(gids if active else []):
        files |= {f"gids/{index}": gid, f"gid_attrs/types/{index}": kind}
        files[f"gid_attrs/ndevs/{index}"] = roce.netdev
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text + "\n")
    host.path(f"/sys/class/infiniband/{device}/device/net/{roce.netdev}").mkdir(parents=True)
    net = host.path(f"/sys/class/net/{roce.netdev}")
    net.mkdir(parents=True, exist_ok=True)
    (net / "mtu").write_text("9000\n")
    if active:
        (net / "speed").write_text("200000\n")


def write_inventory(
    path: Path, head: StagedHost, workers: list[StagedHost], **common: object
) -> Path:
    """An inventory of staged hosts: local connections, no packages, no users, no systemd."""
    common_vars = {
        "ansible_connection": "local",
        "ansible_python_interpreter": MODULE_PYTHON,
        "dgpp_manage_services": False,
        "dgpp_install_packages": False,
        "dgpp_host_create_user": False,
        "dgpp_host_install_python": False,
        "dgpp_user": pwd.getpwuid(os.getuid()).pw_name,
        "dgpp_group": grp.getgrgid(os.getgid()).gr_name,
        "dgpp_webui_user": pwd.getpwuid(os.getuid()).pw_name,
        "dgpp_webui_group": grp.getgrgid(os.getgid()).gr_name,
        "dgpp_webui_create_user": False,
        "dgpp_nfs_weights_mount_state": "present",
        **common,
    }

    def host_vars(host: StagedHost) -> dict[str, object]:
        return {
            "dgpp_rank": host.rank,
            "dgpp_root": str(host.root),
            "dgpp_gpu_clocks_nvidia_smi": str(host.nvidia_smi),
            "dgpp_rdma_ip_command": str(host.ip),
            # The real nft, when installed, checks the ruleset (`--check` changes nothing).
            "dgpp_firewall_nft": shutil.which("nft") or str(host.stand_in / "no-nft"),
            **host.host_vars,
        }

    inventory = {
        "all": {
            "vars": common_vars,
            "children": {
                "head": {"hosts": {head.name: host_vars(head)}},
                "workers": {"hosts": {w.name: host_vars(w) for w in workers}},
            },
        }
    }
    path.write_text(json.dumps(inventory, indent=2))  # JSON is YAML
    return path


@dataclass
class PlaybookRun:
    returncode: int
    output: str

    def recap(self) -> dict[str, dict[str, int]]:
        """host -> {ok, changed, unreachable, failed} from the PLAY RECAP."""
        return {
            match["host"]: {
                key: int(match[key]) for key in ("ok", "changed", "unreachable", "failed")
            }
            for match in RECAP.finditer(self.output)
        }


def ansible_env(home: Path) -> dict[str, str]:
    """ansible-playbook's environment: its state under `home`, no user or site ansible.cfg."""
    home.mkdir(parents=True, exist_ok=True)
    config = home / "ansible.cfg"
    config.write_text("[defaults]\n")
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(config),
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        "ANSIBLE_PIPELINING": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def run_playbook(
    inventory: Path, home: Path, *args: str, timeout: float = 600, playbook: str = "cluster.yml"
) -> PlaybookRun:
    completed = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), playbook, *args],
        cwd=PLAYBOOKS,
        env=ansible_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return PlaybookRun(completed.returncode, completed.stdout + completed.stderr)


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under `root` with its type, mode and contents, links not followed."""
    entries: dict[str, tuple[object, ...]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            info = path.lstat()
            if path.is_symlink():
                entries[str(path)] = ("link", os.readlink(path))
            elif path.is_dir():
                entries[str(path)] = ("dir", info.st_mode)
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                entries[str(path)] = ("file", info.st_mode, info.st_uid, digest, info.st_mtime_ns)
    return entries
