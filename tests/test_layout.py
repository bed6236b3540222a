"""The card's layout (top-level `engine/`, `kernels/`, `appliance/`, `webui/` mapped to `dgpp.*`)
never shadows a package installed beside dgpp for Python started in the repository's root, as
the README's `python -m pytest` is: the root is then first on `sys.path`.

A top-level folder with an `__init__.py` is a regular package and wins over anything later on
`sys.path`; one without is a namespace portion, which the import system takes only when no
regular package of that name exists anywhere on the path. transformers >= 5 imports the PyPI
package `kernels` when a model module loads, so `kernels/` (and every mapped folder that needs
no package-level code) is a namespace portion; `engine/` keeps its `__init__.py` (the offline
API `from dgpp.engine import LLM, SamplingParams`), so no installed package may be named
`engine`.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def mapped_folders(root: Path) -> dict[str, Path]:
    """Top-level folders that pyproject maps to `dgpp.<name>`, by their bare import name."""
    with open(root / "pyproject.toml", "rb") as file:
        package_dir = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    return {
        folder: root / folder
        for package, folder in package_dir.items()
        if package.startswith("dgpp.") and "/" not in folder
    }


def installed_top_level_names() -> set[str]:
    """Import names that distributions other than dgpp install at the top level."""
    return {
        name
        for name, distributions in importlib.metadata.packages_distributions().items()
        if any(distribution.lower() != "dgpp" for distribution in distributions)
    }


def shadowing_folders(root: Path, installed: set[str]) -> list[str]:
    """Mapped folders that Python started in `root` would import instead of an installed
    package of the same name: the regular packages (an `__init__.py`) among them."""
    return sorted(
        name
        for name, folder in mapped_folders(root).items()
        if name in installed and (folder / "__init__.py").exists()
    )


def _python_in_root(code: str) -> subprocess.CompletedProcess[str]:
    """`python -c CODE` started in the repository's root ('' first on sys.path)."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_layout_maps_the_card_folders() -> None:
    assert set(mapped_folders(ROOT)) == {"engine", "kernels", "appliance", "webui"}


def test_no_mapped_folder_shadows_an_installed_package() -> None:
    installed = installed_top_level_names()
    # transformers >= 5 requires the PyPI `kernels`; this suite runs beside it, so the check
    # below is not vacuous for the name that broke a fresh install once.
    assert "kernels" in installed
    assert shadowing_folders(ROOT, installed) == []


def test_the_check_flags_a_regular_package_of_an_installed_name(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"dgpp.kernels" = "kernels"\n"dgpp.webui" = "webui"\n'
    )
    for folder in ("kernels", "webui"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    assert shadowing_folders(tmp_path, {"kernels", "torch"}) == ["kernels"]


def test_the_root_is_on_sys_path_as_the_readme_command_puts_it() -> None:
    # The two imports below prove something only if this process sees the root's folders.
    assert any(Path(entry or ".").resolve() == ROOT for entry in sys.path)


def test_transformers_hub_kernels_imports_in_the_test_process() -> None:
    import transformers.integrations.hub_kernels  # noqa: F401

    import kernels

    assert ROOT / "kernels" not in Path(kernels.__file__).resolve().parents


def test_python_started_in_the_root_imports_every_installed_name_from_site_packages() -> None:
    names = sorted(set(mapped_folders(ROOT)) & installed_top_level_names())
    assert "kernels" in names
    code = (
        "import importlib, transformers.integrations.hub_kernels\n"
        f"for name in {names!r}:\n"
        "    print(name, importlib.import_module(name).__file__)\n"
    )
    result = _python_in_root(code)
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        name, path = line.split(" ", 1)
        assert ROOT / name not in Path(path).resolve().parents, (name, path)


def test_python_started_in_the_root_imports_every_dgpp_package() -> None:
    code = (
        "import dgpp.engine, dgpp.kernels.paged_attention_torch, dgpp.appliance.cli\n"
        "import dgpp.webui.app\n"
        "from dgpp.engine import LLM, SamplingParams\n"
        "print(dgpp.kernels.paged_attention_torch.__file__)\n"
    )
    result = _python_in_root(code)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == ROOT / "kernels" / "paged_attention_torch.py"


def test_transformers_loads_and_runs_a_checkpoint_from_the_root(tmp_path: Path) -> None:
    """What broke a fresh install: a model's module loading the PyPI `kernels` through
    transformers' hub-kernels integration, here from_pretrained and generate on a tiny Llama.
    (The real default GGUF goes through transformers with the root first on `sys.path` as the
    reference of tests/engine/models/test_default_model_parity.py: pytest puts the root there
    too.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "import transformers.integrations.hub_kernels as hub\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, dtype=torch.float32)\n"
        "out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)\n"
        "print(sys.path[0] == '', hub.is_kernels_available(), out.shape[1])\n"
    )
    result = _python_in_root(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "6"]


def test_pytest_runs_with_the_root_first_on_the_path() -> None:
    """So the in-process transformers references (the default GGUF's among them) load as
    Python started in the root does."""
    first = next(Path(entry or ".").resolve() for entry in sys.path if "site-packages" not in entry)
    assert first == ROOT, sys.path[:3]
