"""Section (e) of the GPU check: the hybrid models' Gated DeltaNet path through fla-core's
Triton kernels, against dgpp's PyTorch twins (kernels at tiny and Qwen3-Next sizes), and a tiny
random Qwen3-Next served by dgpp against transformers (`gpu_check_models.model_parity`).

The GPU image has no fla-core: its wheel (and einops', its one dependency) travel with the
checkout in `bench/wheels/` and are unpacked onto `sys.path` before anything imports fla
(`carry_wheels`). The dry run keeps fla absent (on CPU dgpp runs the twins, and transformers'
Qwen3-Next would call fla's kernels on CPU tensors), so there both sides are the twins.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from gpu_check_kernels import TOLERANCE, KernelResult, relative_error, timed_ms

WHEELS = Path(__file__).resolve().parent / "wheels"
# fla's kernels multiply float32 inputs in TF32 (10-bit mantissas) on tensor cores.
TF32_TOLERANCE = 5e-3


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # a finder that refuses outright
        return False


def carry_wheels(folder: Path = WHEELS) -> list[str]:
    """Unpack each wheel in `folder` whose top-level package does not import yet into a
    temporary directory first on `sys.path`; the packages unpacked."""
    unpacked: list[str] = []
    target: Path | None = None
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            tops = {name.split("/")[0] for name in archive.namelist() if "/" in name}
            packages = sorted(t for t in tops if not t.endswith((".dist-info", ".data")))
            if all(_importable(package) for package in packages):
                continue
            target = target or Path(tempfile.mkdtemp(prefix="dgpp-wheels-"))
            archive.extractall(target)
            unpacked += packages
    if target is not None:
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
    return unpacked


def _delta_inputs(
    device: torch.device, batch: int, tokens: int, heads: int, value_heads: int, dim: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device).manual_seed(4)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q, k = draw(batch, tokens, heads, dim), draw(batch, tokens, heads, dim)
    v = draw(batch, tokens, value_heads, dim)
    g = -torch.rand(batch, tokens, value_heads, generator=gen, device=device)  # log decays
    beta = torch.rand(batch, tokens, value_heads, generator=gen, device=device)
    state = 0.1 * draw(batch, value_heads, dim, dim)
    return q, k, v, g, beta, state


def gated_delta_kernels(device: torch.device, dry_run: bool, repeats: int) -> list[KernelResult]:
    """The selected chunk (prefill) and recurrent (decode) forms against the twins in float64:
    a 4K-token prefill of one request and a decode step of 16, Qwen3-Next's 16 key / 32 value
    heads of 128 (tiny sizes in the dry run); float32 and bfloat16 inputs."""
    from dgpp.kernels.gated_delta import select_gated_delta
    from dgpp.kernels.gated_delta_torch import chunk_gated_delta_rule, recurrent_gated_delta_rule

    fns = select_gated_delta(device)
    heads, value_heads, dim = (2, 4, 16) if dry_run else (16, 32, 128)
    cases = [
        ("chunk", fns.chunk, chunk_gated_delta_rule, 1, 96 if dry_run else 4096),
        ("recurrent", fns.recurrent, recurrent_gated_delta_rule, 16, 1),
    ]
    results = []
    for form, kernel_fn, twin_fn, batch, tokens in cases:
        inputs = _delta_inputs(device, batch, tokens, heads, value_heads, dim)
        q, k, v, g, beta, state = (t.double() for t in inputs)
        reference, _ = twin_fn(q, k, v, g, beta, state, use_qk_l2norm=True)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (t.to(dtype) for t in inputs[:3])
            args = (q, k, v, inputs[3], inputs[4], inputs[5])

            def kernel(fn: Any = kernel_fn, args: tuple = args) -> torch.Tensor:
                return fn(*args, use_qk_l2norm=True)[0]

            def twin(fn: Any = twin_fn, args: tuple = args) -> torch.Tensor:
                return fn(*args, use_qk_l2norm=True)[0]

            error = relative_error(kernel(), reference)
            tolerance = (
                TF32_TOLERANCE
                if fns.backend == "fla" and dtype == torch.float32
                else TOLERANCE[dtype]
            )
            results.append(
                KernelResult(
                    f"gated delta {form} ({fns.backend}), {batch} x {tokens}",
                    str(dtype)[6:],
                    error,
                    tolerance,
                    timed_ms(kernel, device, repeats),
                    timed_ms(twin, device, repeats),
                )
            )
    return results


def hybrid(device: torch.device, work: Path, dry_run: bool) -> dict[str, Any]:
    """(e): the kernels above, a tiny Qwen3-Next's greedy parity with transformers and (on a
    GPU) its CUDA-graphed greedy tokens against eager."""
    from gpu_check_build import TINY_QWEN3_NEXT
    from gpu_check_models import graphed_equals_eager, model_parity

    from dgpp.engine import LLM

    kernels = gated_delta_kernels(device, dry_run, 1 if dry_run else 10)
    name, architecture = "tiny Qwen3-Next", "Qwen3NextForCausalLM"
    parity = model_parity(device, work, name, architecture, TINY_QWEN3_NEXT)
    graphed = (
        None  # the dry run: tests/engine/execution/test_decode_graphs.py covers the buffers on CPU
    )
    if not dry_run:
        checkpoint = work / name.replace(" ", "-")  # built by model_parity
        llm = LLM(str(checkpoint), device=device.type, dtype="float32", kv_capacity=1024)
        llm.engine.warm_up()  # captures the graphs
        graphs = llm.engine.runner.graphs
        graphed = graphs is not None and graphed_equals_eager(llm, graphs)
    return {"kernels": kernels, "parity": parity, "graphed_equals_eager": graphed}
