"""The CPU kernels build (or load from the cache) in a process whose PATH lacks the virtual
environment, as a `dgpp@rankN` service started by systemd has: PyTorch's builder runs `ninja`
from PATH, and pip installed it (a dependency of dgpp) beside the interpreter."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from dgpp.kernels.ggml_linear import cpu_extension
sys.exit(0 if cpu_extension() is not None else 3)
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler here")
def test_the_kernel_builds_without_the_venv_on_path(tmp_path: Path) -> None:
    # The service's PATH, less any ninja the distribution installed (this machine may have
    # one in /usr/bin): /usr/bin's commands but ninja, linked into a directory of their own.
    farm = tmp_path / "bin"
    farm.mkdir()
    for command in Path("/usr/bin").iterdir():
        if command.name != "ninja":
            (farm / command.name).symlink_to(command)
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={"PATH": f"{farm}:/usr/sbin", "HOME": str(Path.home())},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
