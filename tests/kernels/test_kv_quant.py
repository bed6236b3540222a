"""Quantized KV rows (`kernels.kv_quant`): int8 and int4 rows are ggml's Q8_0 and Q4_0 blocks
byte for byte as gguf's own quantizer writes them and decode bit for bit as its dequantizer
does; fp8 rows decode as their scale times their e4m3 codes; and the paged-attention twin over
quantized caches equals the twin over the same caches decoded (decode rows, verify rows, prefill
chunks, a window, sinks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.kernels.kv_quant import kv_format
from dgpp.kernels.kv_rotation import rotate, rotation
from dgpp.kernels.paged_attention_cpu import cpu_extension, paged_attention_cpu
from dgpp.kernels.paged_attention_torch import paged_attention, store_kv

GGML = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_0}


def _heads(seed: int, dim: int = 128) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, dim, generator=gen) * 3
    x[0, 0] = 0  # an all-zero block: scale 0
    x[0, 1, :32] = 0.5  # halves exactly: ggml rounds them away from zero
    x[1, 0, 5] = 1e4  # one outlier in a block
    x[1, 1, :32] = 0.49999997 * 127 / x[1, 1, :32].abs().max()  # just below a half, scaled
    return x


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_int_rows_are_ggml_blocks_byte_for_byte(name: str, dim: int) -> None:
    x = _heads(dim, dim)
    fmt = kv_format(name, dim)
    rows = fmt.encode(x)
    theirs = quantize(x.numpy().reshape(-1, dim), GGML[name])
    assert np.array_equal(rows.numpy().reshape(theirs.shape), theirs)
    ours = fmt.decode(rows, torch.float32).numpy()
    assert np.array_equal(ours.reshape(-1, dim), dequantize(theirs, GGML[name]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=32, max_size=32))
def test_int8_matches_ggml_on_any_block(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32).view(1, 1, 32)
    rows = kv_format("int8", 32).encode(x)
    theirs = quantize(x.numpy().reshape(1, 32), GGML["int8"])
    assert np.array_equal(rows.numpy().reshape(theirs.shape), theirs)


def test_fp8_rows_are_a_scale_and_e4m3_codes() -> None:
    x = _heads(1)
    fmt = kv_format("fp8_e4m3", 128)
    assert fmt.width == 130  # one float16 scale per head
    rows = fmt.encode(x)
    scale = rows[..., :2].contiguous().view(torch.float16).float()
    codes = rows[..., 2:].contiguous().view(torch.float8_e4m3fn).float()
    assert torch.equal(fmt.decode(rows, torch.float32), codes * scale)
    nonzero = x.abs().amax(-1) > 0
    error = (fmt.decode(rows, torch.float32) - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-9)
    assert float(error[nonzero].max()) < 0.05


def test_fp8_rows_at_a_static_scale_saturate_as_calibrated() -> None:
    """A checkpoint's k_scale: d is its float16 value on every row, codes e4m3(x / d) clamped
    to +-448 (a value past the calibrated range saturates, it does not overflow to NaN)."""
    x = _heads(1)
    fixed = torch.tensor(float(x.abs().max()) / 600.0)  # the largest values go past 448 d
    rows = kv_format("fp8_e4m3", 128).encode(x, fixed)
    d = fixed.half().float()
    assert torch.equal(
        rows[..., :2].contiguous().view(torch.float16).float(), d.expand(*x.shape[:-1], 1)
    )
    want = (x.float() / d).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(rows[..., 2:], want)
    assert int((rows[..., 2:].view(torch.float8_e4m3fn).float().abs() == 448).sum()) > 0


@pytest.mark.parametrize(("name", "limit"), [("int8", 0.01), ("fp8_e4m3", 0.05), ("int4", 0.15)])
def test_small_heads_are_one_block(name: str, limit: float) -> None:
    x = torch.randn(9, 2, 16)
    fmt = kv_format(name, 16)
    assert fmt.group == 16
    back = fmt.decode(fmt.encode(x), torch.float32)
    assert float((back - x).norm() / x.norm()) < limit


def paged_step(
    rows: list[tuple[int, int]], decodes: int, block: int = 8
) -> tuple[BatchLayout, int]:
    """A step of `rows` (length, query tokens) over pages listed out of order; the pages used."""
    tables, first = [], 0
    for length, _ in rows:
        count = -(-length // block)
        tables.append(list(range(first, first + count))[::-1])  # pages out of order
        first += count
    pairs = zip(rows, tables, strict=True)
    batch = tuple(BatchRow(length - q, q, table) for (length, q), table in pairs)
    layout = BatchLayout(batch, decodes, block, True)
    return layout, first


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize(
    ("window", "sinks"), [(None, False), (11, False), (None, True)], ids=["full", "window", "sinks"]
)
def test_the_twin_reads_quantized_rows_as_their_decoded_values(
    name: str, window: int | None, sinks: bool
) -> None:
    heads, kv_heads, dim = 4, 2, 32
    fmt = kv_format(name, dim)
    layout, blocks = paged_step([(23, 1), (30, 3), (40, 12)], decodes=2)  # decode, verify, chunk
    metadata = TorchPagedAttention(torch.device("cpu")).prepare(layout)
    gen = torch.Generator().manual_seed(3)
    tokens = blocks * 8
    key, value = (torch.randn(tokens, kv_heads, dim, generator=gen) for _ in range(2))
    slots = torch.randperm(tokens, generator=gen)
    packed = torch.zeros(2, blocks, 8, kv_heads, fmt.width, dtype=torch.uint8)
    store_kv(key, value, packed[0], packed[1], slots, fmt)
    plain = fmt.decode(packed, torch.float32)  # the whole cache decoded: the reference only
    query = torch.randn(metadata.query_start_loc_host[-1], heads, dim, generator=gen)
    sink = torch.randn(heads, generator=gen) if sinks else None
    got = paged_attention(query, packed[0], packed[1], metadata, 0.2, sink, window, kv=fmt)
    want = paged_attention(query, plain[0], plain[1], metadata, 0.2, sink, window)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_the_compiled_cpu_kernel_reads_quantized_rows_as_the_twin(name: str) -> None:
    """Prefill chunks, verify and decode rows through the compiled kernel over int8 or fp8 rows
    (each block of keys and values decoded beside it), against the twin over the same rows."""
    if cpu_extension() is None:
        pytest.skip("the CPU attention kernel cannot be built here")
    heads, kv_heads, dim = 4, 2, 64
    fmt = kv_format(name, dim)
    layout, blocks = paged_step([(23, 1), (30, 3), (300, 40)], decodes=2)  # long enough to split
    metadata = TorchPagedAttention(torch.device("cpu")).prepare(layout)
    gen = torch.Generator().manual_seed(4)
    tokens = blocks * 8
    key, value = (torch.randn(tokens, kv_heads, dim, generator=gen) for _ in range(2))
    packed = torch.zeros(2, blocks, 8, kv_heads, fmt.width, dtype=torch.uint8)
    store_kv(key, value, packed[0], packed[1], torch.randperm(tokens, generator=gen), fmt)
    query = torch.randn(metadata.query_start_loc_host[-1], heads, dim, generator=gen)
    want = paged_attention(query, packed[0], packed[1], metadata, 0.2, kv=fmt)
    got = paged_attention_cpu(query, packed[0], packed[1], metadata, 0.2, kv=fmt)
    assert float((got - want).abs().max()) < 1e-5
    assert not torch.equal(got, want)  # the kernel's own arithmetic (a polynomial exp) ran


def test_the_int4_rotation_is_its_own_orthonormal_inverse() -> None:
    """`kernels.kv_rotation`: block-diagonal normalized Hadamard blocks of 64, symmetric,
    R R = I (dot products kept, an output turned back by the same call); none for heads that
    are no multiple of 64."""
    r = rotation(192, torch.device("cpu"), torch.float64)
    assert r is not None and r.shape == (192, 192)
    torch.testing.assert_close(r, r.T)
    torch.testing.assert_close(r @ r, torch.eye(192, dtype=torch.float64))
    assert float(r[:64, 64:].abs().max()) == 0.0  # blocks of 64
    assert rotation(48, torch.device("cpu"), torch.float32) is None
    x = torch.randn(5, 3, 192, dtype=torch.float64)
    torch.testing.assert_close(rotate(rotate(x, r), r), x)
