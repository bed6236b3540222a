"""The repository stays ruff-clean (lint and format) and every module stays under 400 lines
(imports: tests/test_imports.py)."""

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
