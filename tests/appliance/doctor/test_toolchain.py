"""The ptxas check: the installed Triton's bundled ptxas replaced by fake scripts (one refusing
sm_121a as CUDA < 12.9 does, one accepting it), standing in for a GB10's toolchain."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.appliance.doctor.gpu import Gpu, GpuInventory
from dgpp.appliance.doctor.toolchain import toolchain_checks
from dgpp.kernels import ptxas as ptxas_module
from tests.kernels.test_ptxas import write_ptxas

SPARK = GpuInventory(
    (Gpu(0, "NVIDIA GB10", "0000000F:01:00.0", is_integrated=True, capability=(12, 1)),)
)


@pytest.fixture
def old_triton(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Triton whose bundled ptxas refuses sm_121a, and no /usr/local/cuda."""
    bundled = tmp_path / "triton" / "bin"
    write_ptxas(bundled, accepts=False)
    monkeypatch.setattr(ptxas_module, "_triton_bin", lambda: bundled)
    monkeypatch.setattr(ptxas_module, "TOOLKIT_PTXAS", ())
    return tmp_path


def test_a_toolkit_ptxas_that_can_is_named(old_triton: Path) -> None:
    toolkit = write_ptxas(old_triton / "cuda" / "bin", accepts=True)
    (check,) = toolchain_checks(SPARK, {"CUDA_HOME": str(old_triton / "cuda")})
    assert check.status == "warn"
    assert f"{toolkit} can" in check.detail
    assert f"the engine sets TRITON_PTXAS_PATH={toolkit} at start" in check.fix


def test_no_ptxas_that_can_warns_with_the_toolkit_fix(old_triton: Path) -> None:
    (check,) = toolchain_checks(SPARK, {})
    assert check.status == "warn" and check.detail.startswith("no ptxas targets sm_121a")
    assert "CUDA toolkit of 12.9 or later" in check.fix


def test_an_operator_ptxas_is_checked(old_triton: Path) -> None:
    good = write_ptxas(old_triton / "good", accepts=True)
    (check,) = toolchain_checks(SPARK, {"TRITON_PTXAS_PATH": str(good)})
    assert check.status == "pass"
    bad = write_ptxas(old_triton / "bad", accepts=False)
    (check,) = toolchain_checks(SPARK, {"TRITON_PTXAS_PATH": str(bad)})
    assert check.status == "warn" and "cannot target sm_121a" in check.detail


def test_a_bundled_ptxas_that_can_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_ptxas(tmp_path, accepts=True)
    monkeypatch.setattr(ptxas_module, "_triton_bin", lambda: tmp_path)
    (check,) = toolchain_checks(SPARK, {})
    assert (check.status, check.detail) == ("pass", "Triton's bundled ptxas targets sm_121a")


def test_no_gpu_no_finding_and_an_unknown_capability_is_unknown() -> None:
    assert toolchain_checks(GpuInventory(reason="no GPU"), {}) == []
    (check,) = toolchain_checks(GpuInventory((Gpu(0, "X", "?"),)), {})
    assert check.status == "unknown"
    (check,) = toolchain_checks(GpuInventory((Gpu(0, "H100", "?", capability=(9, 0)),)), {})
    assert check.status == "pass"
