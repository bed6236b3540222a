"""The compiled group-quantized CPU kernel equals its PyTorch twin (exact dequantization +
F.linear) for every codebook and scale layout the checkpoint formats produce, on the register path
(M < GEMM_ROWS) and the GEMM path, with row counts and group sizes that leave tails; its
dequantizer is bit-exact, on the AVX2 decoders and on the portable one."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.group_codes import (
    GroupFormat,
    GroupWeight,
    codebook_values,
    dequantize_group,
    pack_nibbles,
    unpack_codes,
)
from dgpp.kernels.group_linear_cpu import (
    GEMM_ROWS,
    cpu_extension,
    group_dequantize_cpu,
    group_linear_cpu,
)
from dgpp.kernels.group_linear_torch import group_linear_torch

ROWS = 40  # not a multiple of the 16-row parallel grain nor of 8
NO_GLOBAL = torch.empty(0)  # the kernel's "no global scale"
# name: (codebook, group size, cols, scale dtype, zeros, global mode (+ " rows": per row), perm)
CASES = {
    "int4 g32": ("int4", 32, 160, torch.float16, False, None, False),
    "int4 g32 perm": ("int4", 32, 96, torch.float16, False, None, True),
    "uint4 g32 zeros": ("uint4", 32, 160, torch.float16, True, None, False),
    "uint4 g128 zeros wide": ("uint4", 128, 4096, torch.float16, True, None, False),
    "uint4 g16 bf16": ("uint4", 16, 96, torch.bfloat16, False, None, False),
    "e2m1 g16 global div": ("e2m1", 16, 160, "e4m3", False, "div", False),
    "e2m1 g16 global mul": ("e2m1", 16, 96, "e4m3", False, "mul", False),
    "e2m1 g16 global div rows": ("e2m1", 16, 160, "e4m3", False, "div rows", False),
    "e2m1 g16 global mul rows": ("e2m1", 16, 96, "e4m3", False, "mul rows", False),
    "e2m1 g32 pow2 bf16": ("e2m1", 32, 160, "pow2", False, None, False),
    "e4m3 g128 float32": ("e4m3", 128, 256, torch.float32, False, None, False),
    "e4m3 per channel": ("e4m3", 96, 96, torch.float32, False, None, False),
    "e4m3 per channel wide": ("e4m3", 4096, 4096, torch.bfloat16, False, None, False),
    "e4m3 g16 zeros": ("e4m3", 16, 160, torch.bfloat16, True, None, False),
}


@pytest.fixture(scope="module")
def extension() -> object:
    ext = cpu_extension()
    if ext is None:
        pytest.skip("the group-quantized CPU kernel did not build (needs a C++ compiler, ninja)")
    return ext


def _weight(name: str, rows: int = ROWS, seed: int = 0) -> tuple[GroupWeight, GroupFormat]:
    codebook, group, cols, scale_kind, zeros, mode, perm = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    groups = cols // group
    if codebook == "e4m3":
        codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    else:
        codes = pack_nibbles(torch.randint(0, 16, (rows, cols), generator=gen))
    if scale_kind == "e4m3":  # NVFP4: float16 holding e4m3 values (positive normals)
        raw = torch.randint(0x08, 0x7F, (rows, groups), generator=gen, dtype=torch.uint8)
        scales = raw.view(torch.float8_e4m3fn).to(torch.float16)
    elif scale_kind == "pow2":  # MXFP4: bfloat16 powers of two
        exps = torch.randint(-10, 2, (rows, groups), generator=gen).to(torch.float32)
        scales = torch.exp2(exps).to(torch.bfloat16)
    else:
        scales = (torch.rand(rows, groups, generator=gen) * 0.02 + 1e-3).to(scale_kind)
    weight = GroupWeight(
        codes=codes,
        scales=scales,
        zeros=torch.randint(0, 16, (rows, groups), generator=gen, dtype=torch.uint8)
        if zeros
        else None,
        global_scale=None if mode is None else _global_scale(mode, rows, gen),
        perm=torch.randperm(cols, generator=gen) if perm else None,
    )
    return weight, GroupFormat(codebook, group, None if mode is None else mode.split()[0])


def _global_scale(mode: str, rows: int, gen: torch.Generator) -> torch.Tensor:
    """float32 []: NVFP4's one global scale (compressed-tensors divides, ModelOpt multiplies), or
    [rows]: one per output row (fused projections keep each part's own)."""
    value = torch.tensor(2688.0 / 3.7 if mode.startswith("div") else 3.7 / 2688.0)
    if not mode.endswith("rows"):
        return value
    return value * (0.5 + torch.rand(rows, generator=gen))


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 13, GEMM_ROWS, 33])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_equals_its_twin(extension: object, name: str, m: int) -> None:
    weight, fmt = _weight(name, seed=m)
    cols = CASES[name][2]
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    expected = group_linear_torch(x, weight, fmt)
    got = group_linear_cpu(x, weight, fmt)
    assert got.shape == (m, ROWS) and got.dtype == torch.float32
    _close(got, expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_leading_dimensions_are_kept(extension: object, name: str) -> None:
    weight, fmt = _weight(name, seed=5)
    x = torch.randn(2, 3, CASES[name][2], generator=torch.Generator().manual_seed(5))
    got = group_linear_cpu(x, weight, fmt)
    assert got.shape == (2, 3, ROWS)
    _close(got, group_linear_torch(x, weight, fmt))
    flat = group_linear_cpu(x.reshape(6, -1), weight, fmt)
    assert torch.equal(got.reshape(6, ROWS), flat)


def test_global_scale_without_a_mode_multiplies(extension: object) -> None:
    """`effective_scales` multiplies by a global scale unless the format says "div"."""
    weight, fmt = _weight("e2m1 g16 global mul", seed=9)
    fmt = GroupFormat(fmt.codebook, fmt.group_size, None)
    x = torch.randn(3, CASES["e2m1 g16 global mul"][2], generator=torch.Generator().manual_seed(9))
    _close(group_linear_cpu(x, weight, fmt), group_linear_torch(x, weight, fmt))
    assert torch.equal(
        group_dequantize_cpu(weight, fmt, x.shape[-1]), dequantize_group(weight, fmt)
    )


def _packed(weight: GroupWeight, fmt: GroupFormat, lut: torch.Tensor | None = None) -> tuple:
    """The kernel's weight arguments: codes, scales, zeros, lut, bits, group size."""
    zeros = torch.empty(0, dtype=torch.uint8) if weight.zeros is None else weight.zeros
    lut = codebook_values(fmt.codebook) if lut is None else lut
    return weight.codes, weight.scales, zeros, lut, fmt.bits, fmt.group_size


def _global(weight: GroupWeight, fmt: GroupFormat) -> tuple[torch.Tensor, int]:
    if weight.global_scale is None:
        return NO_GLOBAL, 0
    return weight.global_scale.reshape(-1), 1 if fmt.global_mode == "div" else 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_portable_path_equals_the_twin(extension: object, name: str) -> None:
    weight, fmt = _weight(name, seed=11)
    for m in (1, 5, GEMM_ROWS + 1):
        x = torch.randn(m, CASES[name][2], generator=torch.Generator().manual_seed(m))
        expected = group_linear_torch(x, weight, fmt)
        if weight.perm is not None:
            x = x.index_select(-1, weight.perm)
        packed, glob = _packed(weight, fmt), _global(weight, fmt)
        _close(extension.group_linear(x, *packed, *glob, GEMM_ROWS, portable=True), expected)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_dequantizer_is_bit_exact(extension: object, name: str, portable: bool) -> None:
    weight, fmt = _weight(name, rows=19, seed=3)
    cols = CASES[name][2]
    expected = dequantize_group(weight, fmt)
    if portable:
        packed, glob = _packed(weight, fmt), _global(weight, fmt)
        got = extension.group_dequantize(*packed, cols, *glob, portable=True)
    else:
        got = group_dequantize_cpu(weight, fmt, cols)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zeros", [False, True])
def test_any_code_table(extension: object, bits: int, zeros: bool) -> None:
    """Tables that are no codebook (the generic 16-entry permute and 256-entry gather decoders);
    NaN codes of the e4m3 table stay NaN."""
    gen = torch.Generator().manual_seed(bits + zeros)
    cols, group = 96, 32
    lut = torch.randn(1 << bits, generator=gen)
    codes = torch.randint(0, 256, (ROWS, cols * bits // 8), generator=gen, dtype=torch.uint8)
    scales = torch.rand(ROWS, cols // group, generator=gen).to(torch.float16)
    zero_codes = torch.randint(0, 16, (ROWS, cols // group), generator=gen, dtype=torch.uint8)
    weight = GroupWeight(codes, scales, zero_codes if zeros else None)
    fmt = GroupFormat("uint4" if bits == 4 else "e4m3", group)
    values = lut[unpack_codes(codes, bits)]
    grouped = values.view(ROWS, cols // group, group)
    if zeros:
        grouped = grouped - zero_codes.to(torch.float32).unsqueeze(-1)
    dense = (grouped * scales.to(torch.float32).unsqueeze(-1)).view(ROWS, cols)
    packed = _packed(weight, fmt, lut)
    for portable in (False, True):
        got = extension.group_dequantize(*packed, cols, NO_GLOBAL, 0, portable=portable)
        assert torch.equal(got, dense)
        for m in (1, 6, GEMM_ROWS):
            x = torch.randn(m, cols, generator=gen)
            y = extension.group_linear(x, *packed, NO_GLOBAL, 0, GEMM_ROWS, portable=portable)
            _close(y, x @ dense.T)
    nan = GroupWeight(torch.full((2, 16), 0xFF, dtype=torch.uint8), torch.ones(2, 1))
    assert group_dequantize_cpu(nan, GroupFormat("e4m3", 16), 16).isnan().all()
    x = torch.ones(1, 16)
    assert group_linear_cpu(x, nan, GroupFormat("e4m3", 16)).isnan().all()


def test_other_dtypes_and_group_sizes_take_the_twin() -> None:
    weight, fmt = _weight("int4 g32", seed=7)
    x = torch.randn(2, 160, dtype=torch.bfloat16)
    got = group_linear_cpu(x, weight, fmt)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, group_linear_torch(x, weight, fmt))
    codes = pack_nibbles(torch.randint(0, 16, (4, 24)))  # group size 8: not a multiple of 16
    small = GroupWeight(codes, torch.rand(4, 3).to(torch.float16))
    fmt8 = GroupFormat("int4", 8)
    x = torch.randn(3, 24)
    assert torch.equal(group_linear_cpu(x, small, fmt8), group_linear_torch(x, small, fmt8))


def test_bad_shapes_are_refused(extension: object) -> None:
    weight, fmt = _weight("int4 g32", seed=0)
    packed = _packed(weight, fmt)
    with pytest.raises(RuntimeError, match="K \\* bits / 8"):
        extension.group_linear(torch.randn(1, 96), *packed, NO_GLOBAL, 0, GEMM_ROWS)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        extension.group_linear(torch.randn(1, 160), *packed[:5], 40, NO_GLOBAL, 0, GEMM_ROWS)
    weight, fmt = _weight("e2m1 g16 global div rows", seed=0)
    with pytest.raises(RuntimeError, match="global_scale must be"):
        extension.group_linear(torch.randn(1, 160), *_packed(weight, fmt), torch.ones(3), 1, 16)
