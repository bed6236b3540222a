"""A real systemd in a throwaway Debian container, for the unit tests that need one.

The root is built once and cached outside the repository, in two layers under
`/var/cache/dgpp-test/`:

* `nspawn-base-<hash>`: `debootstrap` of Debian bookworm (Python 3.11, which the local torch
  wheel needs) with systemd from bookworm-backports (>= 254: `RestartSteps=`), dbus, python3-venv,
  iproute2, curl, ca-certificates and sudo (~2 min the first time);
* `nspawn-venv-<hash>`: an overlay upper layer holding `/opt/dgpp/venv` with torch 2.13.0 (CPU)
  and dgpp's dependencies at the lock's versions (`constraints.txt`, as `scripts/install.sh`
  installs them): the host downloads them (torch from its wheel directory `/opt/wheels`) and the
  container installs them with `--no-index`. Keyed on pyproject's dependency list and the lock.

Each boot stacks a fresh, empty upper directory on those layers (overlayfs), so a run never
changes the cache. `systemd-nspawn --register=no --keep-unit -b` runs the container; commands
enter it with `nsenter --all` on its PID 1 (there is no machined registration, hence no
`machinectl` or `systemd-run --machine`). nspawn (and with it the container's systemd) is first
moved into a private sub-cgroup of this process's own, so nothing is created in the host's
cgroups but that one directory, removed afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from contextlib import suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path("/var/cache/dgpp-test")
MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
PACKAGES = ["systemd", "dbus", "python3", "python3-venv", "iproute2", "curl", "ca-certificates"]
# ansible.builtin.pip imports `packaging` on the target's Python (for the playbook test).
PACKAGES += ["python3-packaging"]
# The console's restart path for the webui test: the role picks sudo (no polkitd here).
PACKAGES += ["sudo"]
# The two-host cluster test: Ansible reaches each container over SSH,
PACKAGES += ["openssh-server"]
# ...and the head loads its dgpp firewall for real (role dgpp_firewall).
PACKAGES += ["nftables"]
BACKPORTS = ["systemd", "systemd-sysv", "libpam-systemd", "libsystemd-shared"]
TORCH = "torch==2.13.0"
WHEELS = Path("/opt/wheels")  # where this host's pip finds torch 2.13.0+cpu (pip config find-links)
LOCK = ROOT / "constraints.txt"
VENV = "/opt/dgpp/venv"
NSPAWN = ["systemd-nspawn", "--register=no", "--keep-unit", "--quiet"]
# The container gets a pure cgroup v2 tree even on a hybrid host; systemd >= 256 wants one.
NSPAWN_ENV = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
CONTAINER_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
CONTAINER_ENV += ["HOME=/root", "LANG=C.UTF-8", "TERM=dumb", "SYSTEMD_PAGER=", "SYSTEMD_COLORS=0"]


def missing_tools() -> list[str]:
    """What this host lacks to build and boot the container (empty: nothing)."""
    tools = ["debootstrap", "systemd-nspawn", "nsenter", "mount"]
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    missing += [str(WHEELS)] if not WHEELS.is_dir() else []
    return missing


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def _dependencies() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["dependencies"]


def stage_checkout(out: Path) -> Path:
    """This checkout's files (tracked and new, not ignored) as pip would see a release."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, names):
        source = ROOT / name.decode()
        if source.is_file():
            target = out / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return out


def cached_layers() -> list[Path]:
    """The read-only layers, top first (overlayfs `lowerdir` order), built when missing."""
    base_key = _key(1, MIRROR, SUITE, PACKAGES, BACKPORTS)
    base = CACHE / f"nspawn-base-{base_key}"
    if not (base / ".dgpp-complete").exists():
        _build_base(base)
    lock = LOCK.read_text()
    venv = CACHE / f"nspawn-venv-{_key(2, base_key, TORCH, _dependencies(), lock)}"
    if not (venv / ".dgpp-complete").exists():
        _build_venv(venv, base)
    return [venv, base]


def _build_base(base: Path) -> None:
    partial = base.with_name(base.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    include = ",".join(PACKAGES)
    _check(["debootstrap", "--variant=minbase", f"--include={include}", SUITE, partial, MIRROR])
    (partial / "etc/apt/sources.list.d/backports.list").write_text(
        f"deb {MIRROR} {SUITE}-backports main\n"
    )
    script = (
        "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
        f"-t {SUITE}-backports {' '.join(BACKPORTS)} && apt-get clean"
    )
    with PrivateCgroup("dgpp-nspawn-build") as cgroup:
        _check([*NSPAWN, "--pipe", "-D", partial, "/bin/sh", "-c", script], cgroup)
    (partial / ".dgpp-complete").touch()
    partial.rename(base)


def _build_venv(layer: Path, base: Path) -> None:
    partial = layer.with_name(layer.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "upper").mkdir(parents=True)
    # Every package at the lock's version, downloaded by the host (PyPI is reachable from the
    # host, not from the container), then installed in the container from that folder alone.
    direct = layer.with_name(layer.name + ".wheels")
    shutil.rmtree(direct, ignore_errors=True)
    direct.mkdir(parents=True)
    constraints = direct / "constraints.txt"
    effective = [sys.executable, ROOT / "scripts" / "constraints.py", "effective", LOCK]
    constraints.write_text(
        subprocess.run(effective, capture_output=True, text=True, check=True).stdout
    )
    wanted = [TORCH, "setuptools>=77", *_dependencies()]
    _check(
        [sys.executable, "-m", "pip", "download", "-q", "--find-links", WHEELS]
        + ["--constraint", constraints, "--dest", direct, *wanted]
    )
    script = (
        f"python3 -m venv {VENV} && {VENV}/bin/pip install -q --disable-pip-version-check "
        "--no-index --find-links /opt/dgpp-direct --constraint /opt/dgpp-direct/constraints.txt "
        + " ".join(f"'{requirement}'" for requirement in wanted)
    )
    binds = [f"--bind-ro={direct}:/opt/dgpp-direct"]
    with Overlay([base], partial) as merged, PrivateCgroup("dgpp-nspawn-build") as cgroup:
        _check([*NSPAWN, "--pipe", *binds, "-D", merged, "/bin/sh", "-c", script], cgroup)
    (partial / "upper" / ".dgpp-complete").touch()
    shutil.rmtree(partial / "work", ignore_errors=True)
    (partial / "upper").rename(layer)
    shutil.rmtree(partial)


def _check(command: list[object], cgroup: PrivateCgroup | None = None) -> None:
    subprocess.run(
        [str(part) for part in command],
        check=True,
        env={**os.environ, **NSPAWN_ENV},
        preexec_fn=cgroup.enter if cgroup else None,
    )


class Overlay:
    """A writable overlay of read-only `layers` (top first) under `work/merged`."""

    def __init__(self, layers: list[Path], work: Path) -> None:
        self.layers = layers
        self.work = work
        self.merged = work / "merged"

    def __enter__(self) -> Path:
        for name in ("upper", "work", "merged"):
            (self.work / name).mkdir(parents=True, exist_ok=True)
        lower = ":".join(str(layer) for layer in self.layers)
        options = f"lowerdir={lower},upperdir={self.work}/upper,workdir={self.work}/work"
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, self.merged], check=True
        )
        return self.merged

    def __exit__(self, *exc: object) -> None:
        if subprocess.run(["umount", self.merged], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", self.merged], check=False)


class PrivateCgroup:
    """A sub-cgroup of this process's own in the cgroup v2 tree and in systemd's named v1
    hierarchy (a hybrid host has both): nspawn creates its `payload` and `supervisor` cgroups
    beside itself, and they must not land in the host's root cgroup."""

    def __init__(self, name: str) -> None:
        self.name = f"{name}-{os.getpid()}"
        self.paths: list[Path] = []

    def __enter__(self) -> PrivateCgroup:
        own = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            own[controllers] = path
        for mount in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = mount.split()
            point, fstype = fields[4], fields[fields.index("-") + 1]
            options = fields[-1]
            if fstype == "cgroup2" and "" in own:
                self.paths.append(Path(point + own[""]) / self.name)
            elif fstype == "cgroup" and "name=systemd" in options and "name=systemd" in own:
                self.paths.append(Path(point + own["name=systemd"]) / self.name)
        for path in self.paths:
            path.mkdir(exist_ok=True)
        return self

    def enter(self) -> None:
        """Move the calling process (a child before exec) into the cgroup."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def __exit__(self, *exc: object) -> None:
        for path in self.paths:
            for attempt in range(50):
                for folder, _, _ in sorted(os.walk(path), key=lambda item: -len(item[0])):
                    with suppress(OSError):
                        os.rmdir(folder)
                if not path.exists():
                    break
                time.sleep(0.1 * attempt)


class Container:
    """A booted container: `start()`, `sh(script)` inside it, `stop()`."""

    def __init__(
        self,
        work: Path,
        binds: dict[str, str],
        machine: str = "dgpp-test",
        netns: Path | None = None,
    ) -> None:
        self.work = work
        self.binds = binds  # host path -> container path, read-only
        self.machine = machine
        # A network namespace the test made (`ip netns add`), or None: a private loopback.
        self.netns = netns
        self.console = work / "console.log"
        self.leader: int | None = None
        self._overlay: Overlay | None = None
        self._cgroup: PrivateCgroup | None = None
        self._nspawn: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> float:
        """Boot; returns the seconds until `systemctl is-system-running` settled."""
        self._overlay = Overlay(cached_layers(), self.work)
        merged = self._overlay.__enter__()
        started = time.monotonic()
        self._cgroup = PrivateCgroup(f"dgpp-nspawn-{self.machine}").__enter__()  # one per box
        binds = [f"--bind-ro={host}:{inside}" for host, inside in self.binds.items()]
        command = [*NSPAWN, "-b", f"--machine={self.machine}", "--console=read-only"]
        # Its own loopback (ports cannot clash), or the test's namespace with its veth.
        # nspawn keeps CAP_NET_ADMIN only with --private-network: the namespace is the
        # container's own all the same (the head loads its nftables ruleset into it).
        network = ["--private-network"]
        if self.netns:
            network = [f"--network-namespace-path={self.netns}", "--capability=CAP_NET_ADMIN"]
        command += [*network, *binds]
        with open(self.console, "wb") as console:
            self._nspawn = subprocess.Popen(
                [*command, "-D", str(merged)],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                env={**os.environ, **NSPAWN_ENV},
                preexec_fn=self._cgroup.enter,
            )
        deadline = time.monotonic() + timeout_s
        state = ""
        # Until systemd runs as PID 1 and answers on its socket, nsenter may land in a namespace
        # still being set up, and systemctl finds no manager.
        while state not in ("running", "degraded"):
            if self._nspawn.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the container did not boot ({state}):\n{self.console_text()}")
            time.sleep(0.2)
            self.leader = _container_init(self._nspawn.pid)
            if self.leader is not None and _comm(self.leader) == "systemd":
                wait = self.sh("systemctl is-system-running --wait", timeout_s, check=False)
                state = wait.stdout.strip()
        return time.monotonic() - started

    def sh(
        self, script: str, timeout_s: float = 600.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a shell script as root inside the container, in its namespaces."""
        assert self.leader is not None, "start() first"
        command = ["nsenter", "--all", "-t", str(self.leader)]
        command += ["env", "-i", "-C", "/", *CONTAINER_ENV, "/bin/sh", "-c", script]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if check and result.returncode != 0:
            raise AssertionError(
                f"in the container: {script}\nexit {result.returncode}\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
        return result

    def console_text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""

    def stop(self, timeout_s: float = 60.0) -> None:
        """Power off (SIGRTMIN+4 to the container's systemd), then drop the overlay."""
        if self._nspawn is not None and self._nspawn.poll() is None:
            if self.leader is not None:
                with suppress(ProcessLookupError):
                    os.kill(self.leader, signal.SIGRTMIN + 4)
            try:
                self._nspawn.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._nspawn.kill()
                self._nspawn.wait()
        if self._cgroup is not None:
            self._cgroup.__exit__(None, None, None)
        if self._overlay is not None:
            self._overlay.__exit__(None, None, None)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _container_init(nspawn_pid: int) -> int | None:
    """The container's PID 1 as this host sees it: a descendant of nspawn whose innermost
    PID is 1."""
    descendants = {nspawn_pid}
    for _ in range(3):
        for status in Path("/proc").glob("[0-9]*/status"):
            with suppress(OSError):
                fields = dict(
                    line.split(":\t", 1)
                    for line in status.read_text().splitlines()
                    if ":\t" in line
                )
                pid, parent = int(fields["Pid"]), int(fields["PPid"])
                if parent in descendants:
                    descendants.add(pid)
                    if fields.get("NSpid", "").split()[-1:] == ["1"] and pid != nspawn_pid:
                        return pid
    return None


if __name__ == "__main__":  # CI builds the cached layers as a stage of its own, timed
    missing = missing_tools()
    if missing:
        print("nspawn root not built, missing: " + ", ".join(missing))
    else:
        print("\n".join(str(layer) for layer in cached_layers()))
