"""The lock (`constraints.txt`, written and applied by `scripts/constraints.py`): it agrees with
pyproject's ranges, and it leaves torch's build and that build's exact pins to the environment."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("dgpp_constraints", ROOT / "scripts/constraints.py")
constraints = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(constraints)

# What a CUDA build of torch asks for: its own triton and CUDA libraries at exact versions.
CUDA_TORCH_REQUIRES = [
    "filelock",
    "sympy>=1.13.3",
    'nvidia-cudnn-cu12==9.10.2.21; platform_system == "Linux"',
    'triton==3.5.1; platform_system == "Linux"',
    'optree==0.13.0; extra == "optree"',
]


def _project_requirements() -> list[Requirement]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        project = tomllib.load(file)["project"]
    names = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    return [Requirement(name) for name in names]


def test_every_locked_version_is_within_pyproject_ranges() -> None:
    locked = constraints.pins(constraints.LOCK.read_text().splitlines())
    for requirement in _project_requirements():
        name = constraints.canonical(requirement.name)
        if name in constraints.UNLOCKED:
            continue
        assert name in locked, f"{name} is a dependency but not in the lock"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            name,
            locked[name],
        )


def test_the_lock_holds_no_torch_and_no_editable_project() -> None:
    locked = constraints.pins(constraints.LOCK.read_text().splitlines())
    assert "torch" not in locked
    assert "dgpp" not in locked
    assert "pip" not in locked


def test_effective_drops_what_a_cuda_build_of_torch_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / "constraints.txt"
    lock.write_text("# header\nsympy==1.14.0\ntriton==3.9.0\nNvidia_CUDNN.cu12==9.1\nzzz==1\n")
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: CUDA_TORCH_REQUIRES)
    assert constraints.torch_exact_pins() == {"triton", "nvidia-cudnn-cu12"}
    assert constraints.effective(lock) == "# header\nsympy==1.14.0\nzzz==1\n"


def test_effective_keeps_triton_beside_a_cpu_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / "constraints.txt"
    lock.write_text("torch==2.13.0\ntriton==3.9.0\n")
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: ["sympy>=1.13.3"])
    assert constraints.effective(lock) == "triton==3.9.0\n"


def test_write_then_diff_of_this_environment_is_empty(tmp_path: Path) -> None:
    lock = tmp_path / "constraints.txt"
    constraints.write(lock)
    text = lock.read_text()
    version = importlib.metadata.version("pytest")
    assert text.startswith("# dgpp's lock")
    assert f"\npytest=={version}\n" in text
    assert constraints.diff(lock) == []
    lock.write_text(text.replace(f"pytest=={version}", "pytest==0.0.1") + "gone-package==1.0\n")
    assert constraints.diff(lock) == ["gone-package: 1.0 -> -", f"pytest: 0.0.1 -> {version}"]


def test_the_command_line_refuses_an_unknown_verb() -> None:
    assert constraints.main(["upgrade"]) == 2
    assert constraints.main([]) == 2
