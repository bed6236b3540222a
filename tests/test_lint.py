"""The repository stays ruff-clean (lint and format), every module stays under 400 lines, and
the engine does not reach up into the appliance."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("engine", "kernels", "appliance", "webui", "bench", "tests")


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_lint_is_clean() -> None:
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_over_400_lines() -> None:
    too_long = {
        str(path.relative_to(ROOT)): n
        for folder in SOURCE_DIRS
        for path in (ROOT / folder).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not too_long, too_long


def test_the_engine_and_kernels_never_import_the_layers_above_them() -> None:
    """The appliance passes the engine what it needs (paths, model names, resident dirs)."""
    import ast

    offenders = []
    for folder in ("engine", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [
                    f"{path.relative_to(ROOT)}: {name}"
                    for name in names
                    if name.startswith(("dgpp.appliance", "dgpp.webui"))
                ]
    assert not offenders, offenders
