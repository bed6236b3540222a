"""A recorded node for the doctor's tests: a root folder holding the files a check reads and a
PATH whose fake tools print recorded output. They stand in for hardware this machine lacks
(a DGX Spark's GB10, an H100, a Spark's cpufreq tree); fixtures/README.md names each record's
source."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dgpp.appliance.doctor.probe import Probe

FIXTURES = Path(__file__).parent / "fixtures"
GPUS = {  # name: (nvidia-smi -q record, --query-gpu=compute_cap record)
    "gb10_healthy": ("nvidia-smi-q_gb10_healthy.txt", "nvidia-smi-compute_cap_gb10.csv"),
    "gb10_pd_throttled": ("nvidia-smi-q_gb10_pd_throttled.txt", "nvidia-smi-compute_cap_gb10.csv"),
    "h100": ("nvidia-smi-q_h100.txt", "nvidia-smi-compute_cap_h100.csv"),
}


def write_tool(bin_dir: Path, name: str, script: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / name
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)
    return tool


def fake_nvidia_smi(bin_dir: Path, query: str | Path, capability: str | Path | None) -> Path:
    """An `nvidia-smi` printing `query` for -q and `capability` for the compute_cap query."""
    cap = (
        f"cat '{capability}'"
        if capability
        else "echo 'Field \"compute_cap\" is not a valid field to query.' >&2; exit 2"
    )
    return write_tool(
        bin_dir,
        "nvidia-smi",
        f"case \"$1\" in\n  -q) cat '{query}' ;;\n  --query-gpu=compute_cap) {cap} ;;\n"
        '  *) echo "unexpected arguments: $*" >&2; exit 2 ;;\nesac\n',
    )


def gpu_tools(bin_dir: Path, gpu: str) -> Path:
    query, capability = GPUS[gpu]
    return fake_nvidia_smi(bin_dir, FIXTURES / query, FIXTURES / capability)


def unpack_sysfs(root: Path, record: str | Path) -> None:
    """Files under `root` from `grep . <files>` output (`/path:value` lines), as recorded."""
    for line in Path(FIXTURES / record).read_text().splitlines():
        path, _, value = line.partition(":")
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(value + "\n")


def spark_root(root: Path, cpufreq: str = "cpufreq_spark_healthy.txt") -> Path:
    """A Spark's /proc/meminfo (page cache), /proc/cpuinfo and cpufreq tree under `root`."""
    (root / "proc").mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / "proc-meminfo_spark_page_cache.txt", root / "proc" / "meminfo")
    shutil.copy(FIXTURES / "proc-cpuinfo_spark.txt", root / "proc" / "cpuinfo")
    unpack_sysfs(root, cpufreq)
    return root


def node_env(bin_dir: Path) -> dict[str, str]:
    """The environment with `bin_dir` first on PATH (the shell's tools stay reachable)."""
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"}


def probe(root: Path, bin_dir: Path) -> Probe:
    return Probe(root, env=node_env(bin_dir))
