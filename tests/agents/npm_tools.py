"""Agent CLIs from npm, installed once into a cache outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def cache_dir() -> Path:
    """`DGPP_AGENT_CACHE`, else /var/cache/dgpp-agents where writable, else ~/.cache."""
    if "DGPP_AGENT_CACHE" in os.environ:
        return Path(os.environ["DGPP_AGENT_CACHE"])
    system = Path("/var/cache/dgpp-agents")
    try:
        system.mkdir(parents=True, exist_ok=True)
        if os.access(system, os.W_OK):
            return system
    except OSError:
        pass
    return Path.home() / ".cache" / "dgpp-agents"


def npm_binary(package: str, version: str, binary: str) -> Path:
    """The path of `binary` from `package@version`, installing it on first use; skips the
    test, saying why, where node/npm are absent or the registry cannot be reached."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    prefix = cache_dir() / f"{package.replace('/', '+')}-{version}"
    path = prefix / "node_modules" / ".bin" / binary
    if path.exists():
        return path
    prefix.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            "npm",
            "install",
            "--no-audit",
            "--no-fund",
            "--prefix",
            str(prefix),
            f"{package}@{version}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if result.returncode != 0 or not path.exists():
        pytest.skip(f"npm could not install {package}@{version}: {result.stderr[-500:]}")
    return path
