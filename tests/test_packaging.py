"""The distribution maps the source folders to dgpp.* in a regular (non-editable) wheel too."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_package_and_the_console_script(tmp_path: Path) -> None:
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
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("dgpp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "engine/__init__.py",
        "engine/models/llama.py",
        "engine/layers/linear.py",
        "kernels/paged_attention_torch.py",
        "appliance/cli.py",
        "appliance/templates/gpt-oss-120b_bfloat16_w1.json",
        "appliance/checkpoint_facts/openai--gpt-oss-120b.json",
        "webui/__init__.py",
    ):
        assert f"dgpp/{module}" in names, module
    assert not any(name.startswith(("tests/", "engine/", "bench/")) for name in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "dgpp = dgpp.appliance.cli:main" in text
