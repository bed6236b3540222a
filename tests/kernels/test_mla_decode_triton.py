"""`mla_decode_triton` against its twin `mla_decode_torch`, under the Triton interpreter on CPU
(small shapes): decode and verify rows over scattered pages, one and two blocks of heads,
float32 and bfloat16, the error ||out - ref|| / ||ref|| against the twin in float64; the twin
against the PyTorch MLA backend's own absorbed decode; and the Triton MLA backend against the
PyTorch one on a step with decode, verify and prefill rows."""

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

import dgpp.kernels.mla_decode_triton as mdt
from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_mla import TorchMLAAttention
from dgpp.engine.backends.triton_mla import TritonMLAAttention
from dgpp.kernels.latent_quant import row_format
from dgpp.kernels.mla_attention_torch import absorbed_attention, store_latent
from dgpp.kernels.mla_decode_triton import mla_decode_torch

BLOCK, RANK, ROPE, NOPE, VALUE = 8, 32, 16, 16, 16
CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (seq_len, query_len) rows: decode rows, a verify row of 3, then (for the backend) a prefill.
DECODE_ROWS = [(9, 1), (40, 1), (23, 3)]
PREFILL_ROWS = [(30, 12)]


@pytest.fixture(autouse=True)
def _interpreted_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted(mdt, "_mla_decode_kernel", monkeypatch)


def _step(rows: list[tuple[int, int]], num_decodes: int, heads: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK) for s, _ in rows) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    batch = []
    for seq_len, q_len in rows:
        batch.append(
            BatchRow(seq_len - q_len, q_len, [free.pop() for _ in range(-(-seq_len // BLOCK))])
        )
    layout = BatchLayout(tuple(batch), num_decodes, BLOCK, prefill_softmax_fp32=True)
    cache = torch.randn(num_blocks, BLOCK, RANK + ROPE, generator=gen)
    tokens = sum(q for _, q in rows)
    q_latent = torch.randn(tokens, heads, RANK, generator=gen)
    q_pe = torch.randn(tokens, heads, ROPE, generator=gen)
    return layout, cache, q_latent, q_pe, gen


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


@needs_interpreter
@pytest.mark.parametrize("heads", [4, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_equals_its_twin(heads: int, dtype: torch.dtype) -> None:
    layout, cache, q_latent, q_pe, _ = _step(DECODE_ROWS, 3, heads, seed=heads)
    metadata = TritonMLAAttention(CPU).prepare(layout)
    scale = (NOPE + ROPE) ** -0.5
    reference = mla_decode_torch(q_latent.double(), q_pe.double(), cache.double(), metadata, scale)
    args = (q_latent.to(dtype), q_pe.to(dtype), cache.to(dtype), metadata, scale)
    got = mdt.mla_decode_triton(*args)
    assert got.dtype == dtype and not got.isnan().any()
    assert relative_error(got, reference) < TOLERANCE[dtype]
    assert relative_error(mla_decode_torch(*args), reference) < TOLERANCE[dtype]


@needs_interpreter
@pytest.mark.parametrize(
    ("kv_dtype", "dtype"),
    [("int8", torch.float32), ("int8", torch.bfloat16), ("fp8_e4m3", torch.bfloat16),
     ("int4", torch.bfloat16)],
    ids=str,
)  # fmt: skip
def test_the_kernel_reads_quantized_latents_as_its_twin(kv_dtype: str, dtype: torch.dtype) -> None:
    """Latents in `kv_dtype`'s blocks, the rope key in the model dtype after them: the kernel
    against the twin over the same rows' dequantized values, in float64."""
    layout, cache, q_latent, q_pe, _ = _step(DECODE_ROWS, 3, 20, seed=5)
    metadata = TritonMLAAttention(CPU).prepare(layout)
    fmt = row_format(kv_dtype, RANK, ROPE)
    stored = fmt.encode(cache.to(dtype).flatten(0, 1)).view(cache.shape[0], BLOCK, -1)
    values = fmt.decode(stored, dtype).double()
    scale = (NOPE + ROPE) ** -0.5
    reference = mla_decode_torch(q_latent.double(), q_pe.double(), values, metadata, scale)
    args = (q_latent.to(dtype), q_pe.to(dtype), stored, metadata, scale, fmt)
    got = mdt.mla_decode_triton(*args)
    assert got.dtype == dtype and not got.isnan().any()
    assert relative_error(got, reference) < TOLERANCE[dtype]
    assert relative_error(mla_decode_torch(*args), reference) < TOLERANCE[dtype]


def test_the_twin_is_the_torch_backends_absorbed_decode() -> None:
    """Single-query decode rows: the twin, projected by W_uv, equals `absorbed_attention` over
    the PyTorch backend's gathered latents and padding mask."""
    rows = [(9, 1), (40, 1), (23, 1)]
    layout, cache, _, q_pe, gen = _step(rows, 3, 4, seed=1)
    metadata = TorchMLAAttention(CPU).prepare(layout)
    kv_b = torch.randn(4, NOPE + VALUE, RANK, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(3, 4, NOPE, generator=gen, dtype=torch.float64)
    q_latent = torch.einsum("thn,hnl->thl", q_nope, kv_b[:, :NOPE])
    twin = mla_decode_torch(q_latent, q_pe.double(), cache.double(), metadata, 0.3)
    projected = torch.einsum("thl,hvl->thv", twin, kv_b[:, NOPE:])
    slots = metadata.decode_slots
    latents = cache.double().view(-1, RANK + ROPE)[slots.view(-1)].view(3, slots.shape[1], -1)
    expected = absorbed_attention(
        q_nope.unsqueeze(2), q_pe.double().unsqueeze(2), latents, kv_b, 0.3, metadata.decode_mask
    ).squeeze(2)
    torch.testing.assert_close(projected, expected)


@needs_interpreter
def test_the_triton_backend_equals_the_torch_backend() -> None:
    rows = DECODE_ROWS + PREFILL_ROWS
    layout, cache, _, _, gen = _step(rows, 3, 4, seed=2)
    tokens = sum(q for _, q in rows)
    q_nope = torch.randn(tokens, 4, NOPE, generator=gen)
    q_pe = torch.randn(tokens, 4, ROPE, generator=gen)
    latent = torch.randn(tokens, RANK + ROPE, generator=gen)
    kv_b = torch.randn(4, NOPE + VALUE, RANK, generator=gen) / RANK**0.5
    results = []
    for backend in (TorchMLAAttention(CPU), TritonMLAAttention(CPU)):
        metadata = backend.prepare(layout)
        results.append(backend.forward(q_nope, q_pe, latent, cache.clone(), kv_b, metadata, 0.2))
    assert relative_error(results[1], results[0].double()) < 1e-5
    fmt = row_format("int8", RANK, ROPE)  # int8 latents: every row kind through both
    quantized = fmt.encode(cache.flatten(0, 1)).view(cache.shape[0], BLOCK, -1)
    results = []
    for backend in (TorchMLAAttention(CPU, "int8"), TritonMLAAttention(CPU, "int8")):
        metadata = backend.prepare(layout)
        step = (q_nope, q_pe, latent, quantized.clone(), kv_b, metadata, 0.2)
        results.append(backend.forward(*step))
    assert relative_error(results[1], results[0].double()) < 1e-5
    stored = cache.clone()
    store_latent(latent, stored, TorchMLAAttention(CPU).prepare(layout).slot_mapping)
    assert not torch.equal(stored, cache)  # the step's latents were written first


def test_cuda_devices_get_the_triton_mla_backend() -> None:
    from dgpp.engine.backends.selection import select_mla_backend

    assert isinstance(select_mla_backend(torch.device("cuda"), torch.bfloat16), TritonMLAAttention)
    assert isinstance(select_mla_backend(CPU, torch.float32), TorchMLAAttention)


if not IN_PROCESS:

    def test_in_a_fresh_interpreter() -> None:
        run_in_a_fresh_interpreter(__file__)
