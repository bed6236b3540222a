"""`rope_store_triton` against its twin `rope_store_torch.rope_store`, under the Triton
interpreter on CPU: query and key heads rotated (grouped heads, q/k/v as slices of one fused
projection), the rotated key and the value written into scattered cache slots and nowhere else
(the caches start NaN-filled), float32 and bfloat16 against a float64 run; and the paged
backends' `angles` path against rotating first."""

from __future__ import annotations

# First: sets TRITON_INTERPRET before anything imports triton.
from tests.kernels.triton_interpret import (
    IN_PROCESS,
    interpreted,
    needs_interpreter,
    run_in_a_fresh_interpreter,
)

# isort: split
import pytest
import torch

import dgpp.kernels.rope_store_triton as rst
from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.backends.triton_paged import TritonPagedAttention
from dgpp.engine.checkpoint.config import RopeConfig
from dgpp.engine.layers.rotary import RotaryEmbedding
from dgpp.kernels.rope_store_torch import apply_rotary, rope_store

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _interpreted_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted(rst, "_rope_store_kernel", monkeypatch)


def _inputs(tokens: int, heads: int, kv_heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen)
    angle = torch.rand(tokens, 1, dim // 2, generator=gen) * 6.28
    cos = torch.cat((angle.cos(), angle.cos()), dim=-1)
    sin = torch.cat((-angle.sin(), angle.sin()), dim=-1)
    slots = torch.randperm(4 * 8, generator=gen)[:tokens]
    return qkv, (cos, sin), slots


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


@needs_interpreter
@pytest.mark.parametrize("shape", [(5, 6, 2, 16), (3, 4, 4, 24), (1, 8, 1, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_equals_its_twin(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    tokens, heads, kv_heads, dim = shape
    qkv, angles, slots = _inputs(tokens, heads, kv_heads, dim, seed=dim)

    def split(x: torch.Tensor):  # slices of the fused projection, as the layers pass them
        return x[:, :heads], x[:, heads : heads + kv_heads], x[:, heads + kv_heads :]

    caches = torch.full((2, 4, 8, kv_heads, dim), float("nan"), dtype=torch.float64)
    wide = tuple(a.double() for a in angles)
    ref_q = rope_store(*split(qkv.double()), wide, caches[0], caches[1], slots)
    got_caches = torch.full((2, 4, 8, kv_heads, dim), float("nan"), dtype=dtype)
    narrow = tuple(a.to(dtype) for a in angles)
    got_q = rst.rope_store_triton(
        *split(qkv.to(dtype)), narrow, got_caches[0], got_caches[1], slots
    )
    assert got_q.dtype == dtype and relative_error(got_q, ref_q) < TOLERANCE[dtype]
    flat_got, flat_ref = got_caches.flatten(1, 2), caches.flatten(1, 2)  # [2, slots, H_kv, D]
    assert relative_error(flat_got[:, slots], flat_ref[:, slots]) < TOLERANCE[dtype]
    others = torch.ones(32, dtype=torch.bool)
    others[slots] = False
    assert flat_got[:, others].isnan().all()  # no other slot written


@needs_interpreter
@pytest.mark.parametrize("backend", [TorchPagedAttention(CPU), TritonPagedAttention(CPU)])
def test_a_backend_given_angles_equals_rotating_first(backend: TorchPagedAttention) -> None:
    rotary = RotaryEmbedding(16, 64, RopeConfig(theta=10000.0))
    rows = (BatchRow(0, 5, [2]), BatchRow(3, 2, [0]))
    layout = BatchLayout(rows, 0, 8, prefill_softmax_fp32=True)
    metadata = backend.prepare(layout)
    positions = torch.tensor([0, 1, 2, 3, 4, 3, 4])
    angles = rotary.lookup(positions, torch.float32)
    qkv, _, _ = _inputs(7, 4, 2, 16, seed=5)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    caches = torch.randn(2, 4, 8, 2, 16)
    fused = backend.forward(q, k, v, caches.clone(), metadata, 0.25, angles=angles)
    first = backend.forward(
        apply_rotary(q, angles), apply_rotary(k, angles), v, caches.clone(), metadata, 0.25
    )
    assert relative_error(fused, first.double()) < 1e-5
    assert backend.fuses_rope == isinstance(backend, TritonPagedAttention)


if not IN_PROCESS:

    def test_in_a_fresh_interpreter() -> None:
        run_in_a_fresh_interpreter(__file__)
