"""`group_linear_triton` against its twin `group_linear_torch`, under the Triton interpreter (CPU).

Triton 3.9 decides interpret mode when a function is decorated with `@triton.jit`: it reads
`TRITON_INTERPRET` (`triton.knobs.runtime.interpret`) then. Triton's own library functions
(`tl.zeros`, `tl.interleave`, ...) are decorated when `triton.language` is first imported, so the
variable must be set before triton is imported at all; an interpreted kernel cannot call library
functions compiled for a GPU. So this module sets the variable before it imports triton, and
wraps the kernel in an `InterpretedFunction` if the kernel module was imported earlier without it.
If another module imported triton earlier without the variable, the checks cannot run in this
process: they are skipped here and run once, all together, in a fresh interpreter process.
The variable stays set for the rest of the session: triton kernels decorated later in the same
pytest process are interpreted too (none are today; a GPU test of them would need its own process).

The interpreter of triton 3.9 multiplies bfloat16 `tl.dot` operands as their raw uint16 bits
(numpy has no bfloat16); the tests widen them to float32 first (exact, as on the GPU: bf16
products are exact in float32 and the sums accumulate in float32).
"""

from __future__ import annotations

# First: sets TRITON_INTERPRET before anything imports triton.
from tests.kernels.triton_interpret import (
    IN_PROCESS,
    interpreted,
    needs_interpreter,
    run_in_a_fresh_interpreter,
)

# isort: split
import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

import dgpp.kernels.group_linear_triton as glt
from dgpp.kernels.group_codes import (
    GroupFormat,
    GroupWeight,
    codebook_values,
    pack_nibbles,
)
from dgpp.kernels.group_linear_torch import group_linear_torch


def _widen_bf16(handle: TensorHandle) -> TensorHandle:
    if handle.dtype != tl.bfloat16:
        return handle
    return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


@pytest.fixture(autouse=True)
def _interpreted_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted(glt, "_group_linear_kernel", monkeypatch)
    create_dot = InterpreterBuilder.create_dot

    def bf16_aware_dot(self, a, b, d, *args):
        return create_dot(self, _widen_bf16(a), _widen_bf16(b), d, *args)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", bf16_aware_dot)


def _e4m3_codes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 codes without the two NaNs (0x7F, 0xFF)."""
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int64)
    return torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)


def _scales(kind: str, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    if kind == "e4m3_in_f16":  # NVFP4: e4m3 block scales, carried as float16
        codes = torch.randint(0x28, 0x50, shape, generator=gen, dtype=torch.uint8)
        return codebook_values("e4m3")[codes.long()].to(torch.float16)
    if kind == "pow2_bf16":  # MXFP4: E8M0 scales, carried as bfloat16 powers of two
        exponents = torch.randint(-6, 2, shape, generator=gen)
        return torch.pow(2.0, exponents.float()).to(torch.bfloat16)
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[kind]
    return (torch.rand(shape, generator=gen) * 0.05 + 0.005).to(dtype)


def make_weight(
    fmt: GroupFormat,
    rows: int,
    cols: int,
    scale_kind: str,
    zeros: bool = False,
    global_scale: float | None = None,
    perm: bool = False,
    seed: int = 0,
) -> GroupWeight:
    gen = torch.Generator().manual_seed(seed)
    if fmt.bits == 4:
        codes = pack_nibbles(torch.randint(0, 16, (rows, cols), generator=gen))
    else:
        codes = _e4m3_codes((rows, cols), gen)
    groups = (rows, cols // fmt.group_size)
    return GroupWeight(
        codes=codes,
        scales=_scales(scale_kind, groups, gen),
        zeros=torch.randint(0, 16, groups, generator=gen).to(torch.uint8) if zeros else None,
        # one global scale per output row (fused NVFP4 shards each bring their own)
        global_scale=None
        if global_scale is None
        else global_scale * (1 + torch.rand(rows, generator=gen)),
        perm=torch.randperm(cols, generator=gen) if perm else None,
    )


# id: (format, rows, cols, scale kind, zeros, global scale, perm)
NVFP4_DIV, NVFP4_MUL = GroupFormat("e2m1", 16, "div"), GroupFormat("e2m1", 16, "mul")
CASES = {
    "int4-g64": (GroupFormat("int4", 64), 40, 192, "f16", False, None, False),
    "uint4-g128": (GroupFormat("uint4", 128), 72, 256, "bf16", False, None, False),
    "uint4-g128-zeros-awq": (GroupFormat("uint4", 128), 40, 256, "f16", True, None, False),
    "uint4-g32-zeros-perm-gptq": (GroupFormat("uint4", 32), 40, 96, "f16", True, None, True),
    "uint4-per-row-zeros": (GroupFormat("uint4", 80), 40, 80, "f16", True, None, False),
    "e2m1-g16-div-nvfp4": (
        GroupFormat("e2m1", 16, "div"),
        40,
        96,
        "e4m3_in_f16",
        False,
        7.5,
        False,
    ),
    "e2m1-g16-mul-nvfp4": (
        GroupFormat("e2m1", 16, "mul"),
        72,
        96,
        "e4m3_in_f16",
        False,
        0.13,
        False,
    ),
    "e2m1-g32-mxfp4": (GroupFormat("e2m1", 32), 72, 160, "pow2_bf16", False, None, False),
    "e4m3-g128": (GroupFormat("e4m3", 128), 40, 256, "f32", False, None, False),
    "e4m3-per-channel": (GroupFormat("e4m3", 96), 40, 96, "f32", False, None, False),
    "e4m3-g16-perm": (GroupFormat("e4m3", 16), 24, 48, "bf16", False, None, True),
}
LEADING = {"m1": (1,), "m5": (5,), "m33": (3, 11)}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def check(case: str, lead: tuple[int, ...], dtype: torch.dtype, seed: int = 1) -> None:
    fmt, rows, cols, scale_kind, zeros, global_scale, perm = CASES[case]
    weight = make_weight(fmt, rows, cols, scale_kind, zeros, global_scale, perm)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((*lead, cols), generator=gen).to(dtype)
    expected = group_linear_torch(x, weight, fmt)
    got = glt.group_linear_triton(x, weight, fmt)
    assert got.dtype == dtype
    assert got.shape == (*lead, rows)
    tol = TOLERANCE[dtype] * expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOLERANCE[dtype], atol=tol)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lead", LEADING.values(), ids=LEADING.keys())
@pytest.mark.parametrize("case", CASES)
def test_matches_the_twin(case: str, lead: tuple[int, ...], dtype: torch.dtype) -> None:
    check(case, lead, dtype)


@needs_interpreter
@pytest.mark.parametrize("case", ["uint4-g128-zeros-awq", "e2m1-g16-div-nvfp4", "e4m3-g128"])
def test_float16_input(case: str) -> None:
    check(case, (5,), torch.float16)


@needs_interpreter
def test_one_dimensional_input_and_empty_batch() -> None:
    check("uint4-g32-zeros-perm-gptq", (), torch.float32)
    fmt, rows, cols, *_ = CASES["int4-g64"]
    weight = make_weight(fmt, rows, cols, "f16")
    out = glt.group_linear_triton(torch.zeros(0, cols), weight, fmt)
    assert out.shape == (0, rows)


@needs_interpreter
def test_non_contiguous_input() -> None:
    fmt, rows, cols, *_ = CASES["e2m1-g32-mxfp4"]
    weight = make_weight(fmt, rows, cols, "pow2_bf16")
    x = torch.randn(cols, 6, generator=torch.Generator().manual_seed(3)).t()
    expected = group_linear_torch(x, weight, fmt)
    got = glt.group_linear_triton(x, weight, fmt)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


if not IN_PROCESS:

    def test_in_a_fresh_interpreter() -> None:
        run_in_a_fresh_interpreter(__file__)
