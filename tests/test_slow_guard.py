"""The slow-test guard (tests/slow_guard.py) and its allow-list (tests/slow_tests.txt)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slow_guard import ALLOW_LIST, LIMIT_S, allowed_patterns, over_limit

ROOT = Path(__file__).resolve().parents[1]


def test_tests_over_the_limit_are_split_by_the_allow_list() -> None:
    durations = {
        "tests/a.py::test_fast": 3.0,
        "tests/a.py::test_slow_allowed[x]": 200.0,
        "tests/b.py::test_slow_new": 130.0,
        "tests/b.py::test_at_the_limit": LIMIT_S,
    }
    allowed, unexpected = over_limit(durations, ["tests/a.py::test_slow_allowed*"])
    assert allowed == [("tests/a.py::test_slow_allowed[x]", 200.0)]
    assert unexpected == [("tests/b.py::test_slow_new", 130.0)]


def test_the_allow_list_names_only_tests_that_exist_and_says_why() -> None:
    lines = [line for line in ALLOW_LIST.read_text().splitlines() if line.strip()]
    entries = [line for line in lines if not line.lstrip().startswith("#")]
    patterns = allowed_patterns()
    assert len(patterns) == len(entries) > 0
    for line, pattern in zip(entries, patterns, strict=True):
        assert "#" in line, f"say why it is slow: {line}"
        path, _, name = pattern.partition("::")
        sources = sorted(ROOT.glob(path))
        assert sources, pattern
        assert any(name.split("[")[0].rstrip("*") in s.read_text() for s in sources), pattern


def test_the_heavy_files_scheduled_first_exist_and_run_first(
    request: pytest.FixtureRequest,
) -> None:
    """tests/conftest.py's HEAVY_FIRST names real files, and collection puts them first in its
    order (xdist hands out files in collection order: `--no-loadscope-reorder`)."""
    from tests.conftest import HEAVY_FIRST

    assert [path for path in HEAVY_FIRST if not (ROOT / path).is_file()] == []
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)
    assert "--no-loadscope-reorder" in request.config.getini("addopts")
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in request.session.items))
    collected = [path for path in HEAVY_FIRST if path in files]
    assert files[: len(collected)] == collected


@pytest.mark.parametrize(
    ("sleep_s", "mode", "code"),
    [
        (0.6, "", 1),  # over twice the limit: fails
        (0.25, "", 0),  # over the limit, under twice: listed only
        (0.25, "strict", 1),
        (0.6, "report", 0),
    ],
)
def test_a_slow_test_off_the_list_is_named_and_fails_the_run_past_twice_the_limit(
    tmp_path: Path, sleep_s: float, mode: str, code: int
) -> None:
    (tmp_path / "allowed.txt").write_text("test_x.py::test_allowed  # a reason\n")
    (tmp_path / "conftest.py").write_text(
        "from pathlib import Path\n"
        "from tests.slow_guard import SlowGuard\n"
        "def pytest_configure(config):\n"
        "    guard = SlowGuard(0.2, Path(__file__).with_name('allowed.txt'))\n"
        "    config.pluginmanager.register(guard, 'guard')\n"
    )
    (tmp_path / "test_x.py").write_text(
        "import time\n"
        "def test_allowed(): time.sleep(0.5)\n"
        "def test_quick(): pass\n"
        f"def test_unlisted(): time.sleep({sleep_s})\n"
    )

    def run(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q"],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            capture_output=True,
            text=True,
            timeout=120,
        )

    result = run(DGPP_SLOW_GUARD=mode)
    assert result.returncode == code, result.stdout
    assert "3 passed" in result.stdout
    assert "test_x.py::test_unlisted  NOT ON THE ALLOW-LIST" in result.stdout
    assert "test_x.py::test_allowed  (allowed: tests/slow_tests.txt)" in result.stdout
    assert "test_quick" not in result.stdout
