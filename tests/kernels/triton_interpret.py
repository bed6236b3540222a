"""Running dgpp's Triton kernels under the Triton interpreter on CPU, for the twin tests.

Triton decides interpret mode when a function is decorated with `@triton.jit`, reading
`TRITON_INTERPRET` then, and its own library functions are decorated when `triton.language` is
first imported: so the variable must be set before triton is imported at all. Importing this
module first sets it when triton is not imported yet. A kernel module imported earlier without it
has its kernels wrapped by `interpreted`. When triton itself was imported earlier without the
variable (another test file in the same worker), the checks cannot run in this process:
`needs_interpreter` skips them and `run_in_a_fresh_interpreter` runs the file again, alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

IN_PROCESS = isinstance(triton.language.zeros, InterpretedFunction)
needs_interpreter = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton was imported before TRITON_INTERPRET=1; test_in_a_fresh_interpreter runs these",
)


def interpreted(module: ModuleType, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`module.name`, a `@triton.jit` kernel, run by the interpreter for this test."""
    kernel = getattr(module, name)
    if IN_PROCESS and not isinstance(kernel, InterpretedFunction):
        monkeypatch.setattr(module, name, InterpretedFunction(kernel.fn))


def run_in_a_fresh_interpreter(test_file: str) -> None:
    """Run `test_file` in a new pytest process with the interpreter on; fail with its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", test_file],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
