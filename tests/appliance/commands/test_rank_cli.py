"""`dgpp rank` and `dgpp serve` refuse bad input before anything starts, with exit code 3 and a
message that names the problem (real processes: a rank ends with `os._exit`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgpp.appliance.common.exit_codes import EXIT_CONFIG, EXIT_USAGE


def _dgpp(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DGPP_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "dgpp.appliance.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


def test_a_rank_is_required() -> None:
    result = _dgpp("rank")
    assert result.returncode == EXIT_CONFIG
    assert "--rank (or DGPP_RANK) must name this rank" in result.stderr


def test_rank_zero_needs_a_deployment() -> None:
    result = _dgpp("rank", "--rank", "0")
    assert result.returncode == EXIT_CONFIG
    assert "rank 0 needs --deployment (or DGPP_DEPLOYMENT)" in result.stderr


def test_the_environment_names_the_rank_and_deployment(tmp_path: Path) -> None:
    deployment = tmp_path / "d.json"
    deployment.write_text(json.dumps({"model": "default", "engine": {"kv_capasity": 1}}))
    result = _dgpp("rank", env={"DGPP_RANK": "0", "DGPP_DEPLOYMENT": str(deployment)})
    assert result.returncode == EXIT_CONFIG
    assert "engine.kv_capasity: unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_timeout_override_is_refused(tmp_path: Path) -> None:
    result = _dgpp(
        "rank", "--rank", "1", env={"DGPP_BOUNDARY_TIMEOUT_MS": "soon", "DGPP_HEAD": "127.0.0.1"}
    )
    assert result.returncode == EXIT_CONFIG
    assert "DGPP_BOUNDARY_TIMEOUT_MS must be a number, got 'soon'" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world", "0"], "world_size: Input should be greater than or equal to 1"),
        (["--model", "/nonexistent/model"], "no such checkpoint directory"),
        (["--kv-capacity", "0"], "engine.kv_capacity: Input should be greater than or equal to 1"),
        (["--spec-ngram-min", "9"], "speculative: Value error, ngram_min (9) must not exceed"),
    ],
)
def test_serve_refuses_bad_settings_before_binding(args: list[str], message: str) -> None:
    result = _dgpp("serve", *args)
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert message in result.stderr


def test_a_non_number_is_a_usage_error() -> None:
    result = _dgpp("rank", "--rank", "one")
    assert result.returncode == EXIT_USAGE
    assert "invalid int value" in result.stderr
