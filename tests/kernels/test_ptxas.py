"""Choosing Triton's `ptxas` for a device, with fake `ptxas` scripts: one that assembles for
sm_121a, one that refuses it with the real ptxas's words (CUDA < 12.9 does not know GB10)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.kernels import ptxas as ptxas_module
from dgpp.kernels.ptxas import can_target, choose_ptxas, ptxas_arch, toolkit_ptxas

REFUSAL = "ptxas fatal   : Value 'sm_121a' is not defined for option 'gpu-name'"


def write_ptxas(folder: Path, accepts: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "ptxas"
    if accepts:  # writes the `-o` file as ptxas does
        body = 'while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\nexit 0\n'
    else:
        body = f'echo "{REFUSAL}" >&2\nexit 255\n'
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)
    return tool


@pytest.fixture
def tools(tmp_path: Path) -> tuple[Path, Path]:
    return write_ptxas(tmp_path / "new" / "bin", True), write_ptxas(tmp_path / "old" / "bin", False)


def test_the_arch_of_a_capability() -> None:
    assert ptxas_arch((12, 1)) == "sm_121a"
    assert ptxas_arch((9, 0)) == "sm_90a"
    assert ptxas_arch((8, 6)) == "sm_86"


def test_can_target_says_what_ptxas_said(tools: tuple[Path, Path], tmp_path: Path) -> None:
    new, old = tools
    assert can_target(new, "sm_121a") == (True, f"{new} targets sm_121a")
    assert can_target(old, "sm_121a") == (False, REFUSAL)
    assert can_target(tmp_path / "absent", "sm_121a") == (
        False,
        f"{tmp_path / 'absent'} does not exist",
    )


def test_a_toolkit_ptxas_is_chosen_when_the_bundled_one_cannot(tools: tuple[Path, Path]) -> None:
    new, old = tools
    path, why = choose_ptxas((12, 1), {}, bundled=old, toolkits=[new])
    assert path == str(new)
    assert why == f"Triton's bundled ptxas cannot target sm_121a ({REFUSAL}); {new} can"


def test_nothing_changes_when_not_needed_or_not_possible(tools: tuple[Path, Path]) -> None:
    new, old = tools
    assert choose_ptxas((12, 1), {}, bundled=new, toolkits=[]) == (
        None,
        "Triton's bundled ptxas targets sm_121a",
    )
    path, why = choose_ptxas((12, 1), {}, bundled=old, toolkits=[old])
    assert path is None and why.startswith("no ptxas targets sm_121a: bundled: ptxas fatal")
    assert choose_ptxas((9, 0), {}, bundled=old, toolkits=[new]) == (
        None,
        "sm_90a: Triton's bundled ptxas serves it",
    )


def test_an_operator_value_wins(tools: tuple[Path, Path]) -> None:
    new, old = tools
    path, why = choose_ptxas(
        (12, 1), {"TRITON_PTXAS_PATH": "/opt/x/ptxas"}, bundled=old, toolkits=[new]
    )
    assert path is None and why == "TRITON_PTXAS_PATH=/opt/x/ptxas is set by the operator"


def test_toolkits_come_from_cuda_home_first(tmp_path: Path) -> None:
    found = toolkit_ptxas({"CUDA_HOME": "/opt/cuda-13", "CUDA_PATH": "/opt/cuda-13"})
    assert found == [Path("/opt/cuda-13/bin/ptxas"), Path("/usr/local/cuda/bin/ptxas")]


def test_triton_blackwell_variable_follows_the_bundled_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ptxas_module, "_triton_bin", lambda: tmp_path)
    write_ptxas(tmp_path, True)
    assert ptxas_module.triton_env_var((12, 1)) == "TRITON_PTXAS_PATH"
    assert ptxas_module.bundled_ptxas((12, 1)) == tmp_path / "ptxas"
    (tmp_path / "ptxas-blackwell").write_bytes((tmp_path / "ptxas").read_bytes())
    assert ptxas_module.triton_env_var((12, 1)) == "TRITON_PTXAS_BLACKWELL_PATH"
    assert ptxas_module.triton_env_var((8, 0)) == "TRITON_PTXAS_PATH"
    assert ptxas_module.bundled_ptxas((12, 1)) == tmp_path / "ptxas-blackwell"
