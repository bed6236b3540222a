"""bench/gpu_check.py --dry-run: the prepared GPU check's code paths on CPU at tiny sizes (the
Triton kernels under the interpreter), so the script a GPU session runs in one go is known to
work before it gets there. It runs where importing FastAPI, llguidance, gguf or fla-core fails,
as on the GPU image (dgpp's engine serves the random checkpoints there: parity with
transformers, decode, prefill); and a checkout maps to `dgpp.*` where dgpp is not installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "gpu_check.py"
ABSENT = ("gguf", "fastapi", "starlette", "uvicorn", "llguidance", "fla")
# The check's process, with those packages' imports failing as on an image without them.
WITHOUT = """
import importlib.abc, runpy, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU image)")

sys.meta_path.insert(0, Absent())
sys.argv = [{check!r}, "--dry-run", "--out", {out!r}]
runpy.run_path({check!r}, run_name="__main__")
"""


def test_the_dry_run_passes_and_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = WITHOUT.format(absent=set(ABSENT), check=str(CHECK), out=str(out))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((out / "gpu_check.json").read_text())
    assert figures["failed"] == [] and figures["dry_run"] is True
    names = {kernel["name"].split(",")[0].split(" ")[0] for kernel in figures["kernels"]}
    assert {"paged", "RMSNorm", "add", "SiLU-and-mul", "int4", "fused"} <= names
    assert all(kernel["ok"] for kernel in figures["kernels"])
    assert {"gated"} <= names and figures["hybrid"]["parity"]["model"] == "tiny Qwen3-Next"
    assert [r["float32_greedy_equal"] for r in figures["parity"]] == [True, True, True]
    assert all(r["bf16_top1_agreement"] > 0.9 for r in figures["parity"])
    assert figures["decode"]["graphed_equals_eager"] is True
    assert {
        "decode_ms_b1",
        "roofline_ms",
        "prefill_tok_s_1024",
        "prefill_attention_share_1024",
    } <= set(figures["decode"])
    assert result.stdout.rstrip().endswith(f"all passed ({figures['seconds']:.0f} s)")
    assert (out / "gpu_check.log").stat().st_size > 0


def test_the_carried_wheels_unpack_where_the_image_lacks_their_packages() -> None:
    """bench/wheels holds fla-core and einops for the GPU image; where they do not import,
    `carry_wheels` puts an unpacked copy first on sys.path (here: site-packages' copies hidden)."""
    code = (
        "import importlib.abc, importlib.machinery, sys\n"
        "class SitePackagesHidden(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] not in ('fla', 'einops'):\n"
        "            return None\n"
        "        spec = importlib.machinery.PathFinder.find_spec(name, path)\n"
        "        if spec is not None and 'dgpp-wheels-' not in str(spec.origin):\n"
        "            raise ModuleNotFoundError(name)\n"
        "        return spec\n"
        "sys.meta_path.insert(0, SitePackagesHidden())\n"
        f"sys.path.insert(0, {str(CHECK.parent)!r})\n"
        "from gpu_check_hybrid import carry_wheels\n"
        "print(sorted(carry_wheels()))\n"
        "import einops, fla\n"
        "print(fla.__file__)\n"
        "print(carry_wheels())\n"  # a second call: everything imports, nothing unpacked
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    unpacked, fla_file, again = result.stdout.strip().splitlines()
    assert unpacked == "['einops', 'fla']" and "dgpp-wheels-" in fla_file and again == "[]"
    wheels = sorted(path.name for path in (ROOT / "bench" / "wheels").glob("*.whl"))
    assert wheels == ["einops-0.8.2-py3-none-any.whl", "fla_core-0.6.0-py3-none-any.whl"]


def test_a_checkout_maps_to_dgpp_where_dgpp_is_not_installed() -> None:
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(CHECK.parent)!r})\n"
        # Hide the editable install (its finder class, its path entry and hook).
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in f.__module__]\n"
        "sys.path[:] = [entry for entry in sys.path if '__editable__' not in entry]\n"
        "sys.path_importer_cache.clear()\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('dgpp') is None, 'dgpp still importable'\n"
        "import gpu_check\n"
        "gpu_check.importable_dgpp()\n"
        "import dgpp.kernels.rms_norm_torch as m\n"
        "print(m.__file__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    path = Path(result.stdout.strip())
    assert path.name == "rms_norm_torch.py" and path.resolve() == ROOT / "kernels" / path.name
