"""The distribution maps the source folders to dgpp.* in a regular (non-editable) wheel too, and
that wheel, installed, imports for Python started in the repository's root (tests/test_layout.py
says why that matters)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build_wheel(out: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("dgpp-*.whl")
    return wheel


def test_wheel_contains_every_package_and_the_console_script(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "engine/__init__.py",
        "engine/models/llama.py",
        "engine/layers/linear.py",
        "kernels/paged_attention_torch.py",
        "appliance/cli.py",
        "appliance/templates/gpt-oss-120b_bfloat16_w1.json",
        "appliance/checkpoint_facts/openai--gpt-oss-120b.json",
        "webui/app.py",
        "webui/templates/base.html",
        "kernels/cpu/ggml_linear.cpp",
    ):
        assert f"dgpp/{module}" in names, module
    assert not any(name.startswith(("tests/", "engine/", "bench/")) for name in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "dgpp = dgpp.appliance.cli:main" in text


def test_the_installed_wheel_imports_from_the_root(tmp_path: Path) -> None:
    """The wheel's files alone (no editable finder: `-S` skips site's .pth files) give every
    dgpp package, and the PyPI `kernels` stays importable beside them."""
    site = tmp_path / "site"
    zipfile.ZipFile(_build_wheel(tmp_path / "wheel")).extractall(site)
    dependencies = [p for p in sys.path if p.endswith("site-packages")]
    code = (
        "import dgpp.engine, dgpp.kernels.paged_attention_torch as attention, dgpp.appliance.cli\n"
        "import dgpp.webui.app, kernels, transformers.integrations.hub_kernels\n"
        "from dgpp.engine import LLM, SamplingParams\n"
        "print(attention.__file__)\n"
        "print(kernels.__file__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": ":".join([str(site), *dependencies])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    ours, theirs = (Path(line) for line in result.stdout.splitlines())
    assert ours == site / "dgpp" / "kernels" / "paged_attention_torch.py"
    assert ROOT / "kernels" not in theirs.parents
