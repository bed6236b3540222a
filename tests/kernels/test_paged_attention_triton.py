"""`paged_attention_triton` against its twin `paged_attention_torch.paged_attention`, under the
Triton interpreter on CPU (small shapes): decode rows, speculative verify rows and prefill chunks
over a cached prefix in one step, grouped query heads, sliding windows and attention sinks, in
float32 and bfloat16. The error is measured as ||out - ref|| / ||ref|| against the twin run in
float64; the kernel writes into a NaN-filled output, so an element it leaves unwritten fails."""

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

import dgpp.kernels.paged_attention_triton as pat
from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.kernels.attention_metadata import token_rows_and_positions
from dgpp.kernels.paged_attention_torch import paged_attention, store_kv
from dgpp.kernels.paged_decode_split import PARTITION_KEYS, decode_split
from dgpp.kernels.paged_prefill_triton import keys_per_step

BLOCK = 8
# (seq_len, query_len) per row; the leading `num_decodes` rows are decode (or verify) rows.
STEPS = {
    "decode": ([(9, 1), (40, 1), (17, 1)], 3),
    "mixed": ([(9, 1), (33, 4), (13, 3), (21, 6), (12, 12)], 3),
    "prefill": ([(20, 20), (27, 9)], 0),
    # Chunks over several tiles of 16 queries and several 32-key steps of the prefill kernel.
    "long": ([(9, 1), (90, 40), (45, 45)], 1),
}
# (query heads, KV heads, head dim): grouped 3:1, one group of 8, and a head dim not a power of 2.
SHAPES = [(6, 2, 16), (8, 1, 32), (4, 4, 24)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
F32, BF16 = torch.float32, torch.bfloat16
# Every step and shape in float32; bfloat16, windows and sinks on fewer (the interpreter is slow).
CASES = (
    [(step, shape, F32, "plain") for step in sorted(STEPS) for shape in SHAPES]
    + [(step, SHAPES[0], BF16, "plain") for step in sorted(STEPS)]
    + [("mixed", shape, F32, v) for shape in SHAPES[:2] for v in ("window", "sinks")]
    + [("mixed", SHAPES[0], BF16, "sinks"), ("decode", SHAPES[1], F32, "window")]
    + [("long", SHAPES[0], F32, "window"), ("long", SHAPES[1], BF16, "sinks")]
)


def case_id(case: tuple[str, tuple[int, int, int], torch.dtype, str]) -> str:
    step, (heads, kv_heads, dim), dtype, variant = case
    return f"{step}-h{heads}-kv{kv_heads}-d{dim}-{str(dtype)[6:]}-{variant}"


@pytest.fixture(autouse=True)
def _interpreted_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted(pat, "_paged_attention_kernel", monkeypatch)


def make_layout(step: str, seed: int) -> tuple[BatchLayout, int]:
    """The step's rows over scattered block tables, and the pool's size in blocks."""
    gen = torch.Generator().manual_seed(seed)
    shapes, num_decodes = STEPS[step]
    num_blocks = sum(-(-s // BLOCK) for s, _ in shapes) + 4
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered block tables
    rows = []
    for seq_len, q_len in shapes:
        table = [free.pop() for _ in range(-(-seq_len // BLOCK))]
        rows.append(BatchRow(seq_len - q_len, q_len, table))
    return BatchLayout(tuple(rows), num_decodes, BLOCK, prefill_softmax_fp32=True), num_blocks


def make_step(step: str, heads: int, kv_heads: int, dim: int, seed: int):
    """A step's queries, its caches (prefix cached, this step's keys stored) and metadata."""
    gen = torch.Generator().manual_seed(seed)
    layout, num_blocks = make_layout(step, seed)
    shapes = STEPS[step][0]
    metadata = TorchPagedAttention(torch.device("cpu")).prepare(layout)
    caches = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, generator=gen)  # stale slots too
    tokens = sum(q for _, q in shapes)
    query = torch.randn(tokens, heads, dim, generator=gen)
    new_kv = torch.randn(2, tokens, kv_heads, dim, generator=gen)
    store_kv(new_kv[0], new_kv[1], caches[0], caches[1], metadata.slot_mapping)
    return query, caches, metadata


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_equals_its_twin(case: tuple[str, tuple[int, int, int], torch.dtype, str]) -> None:
    step, (heads, kv_heads, dim), dtype, variant = case
    query, caches, metadata = make_step(step, heads, kv_heads, dim, seed=len(step) + dim)
    sinks = torch.linspace(-1.0, 2.0, heads) if variant == "sinks" else None
    window = 7 if variant == "window" else None
    scale = dim**-0.5
    reference = paged_attention(
        query.double(), caches[0].double(), caches[1].double(), metadata, scale,
        None if sinks is None else sinks.double(), window,
    )  # fmt: skip
    out = torch.full_like(query, float("nan"), dtype=dtype)
    got = pat.paged_attention_triton(
        query.to(dtype), caches[0].to(dtype), caches[1].to(dtype), metadata, scale,
        None if sinks is None else sinks.to(dtype), window, out=out,
    )  # fmt: skip
    assert got is out and not got.isnan().any()
    assert relative_error(got, reference) < TOLERANCE[dtype]
    twin = paged_attention(
        query.to(dtype), caches[0].to(dtype), caches[1].to(dtype), metadata, scale,
        None if sinks is None else sinks.to(dtype), window,
    )  # fmt: skip
    assert relative_error(twin, reference) < TOLERANCE[dtype]  # the bound suits the twin too


@needs_interpreter
@pytest.mark.parametrize(
    "case",
    [("decode", "plain"), ("mixed", "window"), ("long", "sinks"), ("long", "window")],
    ids="-".join,
)
def test_split_k_decode_equals_the_twin(case: tuple[str, str]) -> None:
    """Decode and verify rows split into partitions of 2 pages (the 90-token row: 6), merged
    by `combine_partitions`; windows skip partitions, sinks join the merge once."""
    step, variant = case
    query, caches, metadata = make_step(step, 6, 2, 16, seed=7)
    assert decode_split(3, 2, metadata.max_seq_len, BLOCK, 16) is not None
    sinks = torch.linspace(-1.0, 2.0, 6) if variant == "sinks" else None
    window = 11 if variant == "window" else None
    reference = paged_attention(
        query.double(), caches[0].double(), caches[1].double(), metadata, 0.25,
        None if sinks is None else sinks.double(), window,
    )  # fmt: skip
    out = torch.full_like(query, float("nan"))
    pat.paged_attention_triton(
        query, caches[0], caches[1], metadata, 0.25, sinks, window, out=out, partition_keys=16
    )
    assert not out.isnan().any()
    assert relative_error(out, reference) < TOLERANCE[F32]


def test_prefill_key_tiles_fit_gb10_shared_memory() -> None:
    for dim in (64, 128, 256):  # head dims of the paged families (MLA has its own kernel)
        for element in (2, 4):
            keys = keys_per_step(dim, element)
            assert 16 <= keys <= 32
            assert 2 * (2 * keys * dim * element) <= 99 * 1024  # K and V, two stages
    assert keys_per_step(128, 2) == 32 and keys_per_step(256, 4) == 16


def test_only_few_programs_over_long_contexts_split() -> None:
    assert decode_split(1, 8, 131072, 16, PARTITION_KEYS) == (256, 32)  # 4K keys a partition
    assert decode_split(1, 8, 4096, 16, PARTITION_KEYS) == (32, 8)  # 512 keys a partition
    assert decode_split(1, 8, 512, 16, PARTITION_KEYS) is None  # one partition's worth
    assert decode_split(64, 8, 131072, 16, PARTITION_KEYS) is None  # enough programs already


@needs_interpreter
def test_rows_and_positions_follow_the_metadata() -> None:
    _, _, metadata = make_step("mixed", 6, 2, 16, seed=0)
    rows, positions = token_rows_and_positions(metadata, 26)
    assert rows.tolist() == [0, 1, 1, 1, 1, 2, 2, 2] + [3] * 6 + [4] * 12
    assert positions[:8].tolist() == [8, 29, 30, 31, 32, 10, 11, 12]
    assert positions[8:14].tolist() == list(range(15, 21))
    assert positions[14:].tolist() == list(range(12))


@needs_interpreter
def test_cuda_devices_get_the_triton_backend_which_agrees_with_the_torch_one() -> None:
    from dgpp.engine.backends.selection import select_attention_backend
    from dgpp.engine.backends.triton_paged import TritonPagedAttention

    assert isinstance(
        select_attention_backend(torch.device("cuda"), torch.bfloat16), TritonPagedAttention
    )
    assert isinstance(
        select_attention_backend(torch.device("cpu"), torch.float32), TorchPagedAttention
    )
    cpu = TorchPagedAttention(torch.device("cpu"))  # the twin itself, the reference
    query, caches, metadata = make_step("mixed", 6, 2, 16, seed=3)
    tokens = query.shape[0]
    new_kv = torch.randn(2, tokens, 2, 16, generator=torch.Generator().manual_seed(4))
    expected = cpu.forward(query, new_kv[0], new_kv[1], caches.clone(), metadata, 0.25)
    triton_backend = TritonPagedAttention(torch.device("cpu"))  # its kernel, interpreted
    own = triton_backend.prepare(make_layout("mixed", seed=3)[0])  # rows, positions on the host
    assert own.decode_slots is None and own.token_rows is not None
    assert own.token_positions is not None
    rows, positions = token_rows_and_positions(metadata, tokens)
    assert own.token_rows.tolist() == rows.tolist()
    assert own.token_positions.tolist() == positions.tolist()
    assert own.slot_mapping.tolist() == metadata.slot_mapping.tolist()
    got = triton_backend.forward(query, new_kv[0], new_kv[1], caches.clone(), own, 0.25)
    assert relative_error(got, expected.double()) < 1e-5


if not IN_PROCESS:

    def test_in_a_fresh_interpreter() -> None:
        run_in_a_fresh_interpreter(__file__)
