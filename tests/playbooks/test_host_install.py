"""The dgpp_host role's real install path on one staged host: a fresh venv, PyTorch chosen as
scripts/install.sh chooses it (no NVIDIA driver here: the pinned CPU build), and dgpp from a
wheel built from (a copy of) this checkout. Needs the package index (pip)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.playbooks.staging import (
    BIN,
    PLAYBOOKS,
    StagedHost,
    run_playbook,
    stage,
    write_inventory,
)

pytestmark = [
    pytest.mark.slow,  # installs torch and dgpp's dependencies into a new venv (~1-2 min)
    pytest.mark.skipif(
        shutil.which("ansible-playbook", path=str(BIN)) is None,
        reason="ansible is not installed (pip install -e '.[test]')",
    ),
]


def checkout_copy(dest: Path) -> Path:
    """The sources a wheel is built from, copied: a tree nobody edits between the two runs."""
    root = PLAYBOOKS.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    for name in ["pyproject.toml", pyproject["project"]["readme"]]:
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, dest / name)
    for folder in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(root / folder, dest / folder, ignore=ignore)
    return dest


def test_host_role_installs_pinned_cpu_torch_and_dgpp_into_a_new_venv(tmp_path: Path):
    host = StagedHost(
        "host0",
        0,
        tmp_path / "host0",
        tmp_path / "stand-in",
        host_vars={
            "dgpp_host_install_python": True,
            "dgpp_host_python": sys.executable,
            "dgpp_host_nvidia_smi": str(tmp_path / "no-driver" / "nvidia-smi"),
            "dgpp_host_checkout_dir": str(checkout_copy(tmp_path / "checkout")),
            "dgpp_host_wheel_build_dir": str(tmp_path / "wheel"),
            # pip's byte-compiling of every installed module (about 15,000 files, half a
            # minute of CPU here) is pip's work, not the role's; Python compiles on first import.
            "dgpp_host_pip_extra_args": "--no-compile",
        },
    )
    stage(host, venv_link=False)
    inventory = write_inventory(tmp_path / "inventory.yml", host, [])
    first = run_playbook(inventory, tmp_path / "ansible", "--tags=dgpp_host")
    assert first.returncode == 0, first.output

    python = host.path("/opt/dgpp/venv/bin/python")
    probe = "import torch, dgpp.appliance.cli as cli; print(torch.__version__); print(cli.__file__)"
    completed = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, check=True, timeout=300
    )
    torch_version, cli_file = completed.stdout.split()
    assert torch_version.split("+")[0] == "2.13.0"
    assert cli_file.startswith(str(host.path("/opt/dgpp/venv")))
    pyproject = tomllib.loads((PLAYBOOKS.parent / "pyproject.toml").read_text())
    wheel = f"dgpp-{pyproject['project']['version']}-py3-none-any.whl"
    assert host.path(f"/opt/dgpp/dist/{wheel}").is_file()

    second = run_playbook(inventory, tmp_path / "ansible", "--tags=dgpp_host")
    assert second.returncode == 0, second.output
    assert second.recap()["host0"]["changed"] == 0, second.output
