"""`fused_moe_triton` against its twin `fused_moe_torch.fused_moe`, under the Triton interpreter
on CPU (small shapes): decode-sized and prefill-sized steps, SiLU and gpt-oss's clamped SwiGLU
with biases, float32 and bfloat16. The error is ||out - ref|| / ||ref|| against the twin run in
float64; the kernels' outputs are NaN-filled first, so a row left unwritten fails. Also: the
device-side layout by expert (`align_by_expert`) and the tile table's shared-memory bounds."""

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

import dgpp.kernels.fused_moe_triton as fmt
from dgpp.kernels.fused_moe_torch import fused_moe
from dgpp.kernels.moe_align import align_by_expert, aligned_capacity
from dgpp.kernels.moe_tiles import DEFAULT_SHARED_LIMIT, SHARED_LIMIT, TABLE, moe_tiles

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
F32, BF16 = torch.float32, torch.bfloat16
# (tokens, hidden, inner, experts, top-k, activation, dtype): decode-sized steps (blocks of 16
# rows), a prefill-sized one (blocks of 64, several per expert), widths not a multiple of the
# tiles, and gpt-oss's activation with biases.
CASES = [
    (1, 64, 32, 8, 2, "silu", F32),
    (5, 48, 40, 6, 3, "silu", F32),
    (150, 64, 32, 4, 2, "silu", F32),
    (7, 64, 32, 8, 2, "swiglu_oai", F32),
    (5, 64, 32, 8, 2, "silu", BF16),
    (7, 64, 32, 8, 2, "swiglu_oai", BF16),
    (9, 64, 32, 8, 2, "swiglu_clamp", F32),  # DeepSeek-V4's
]


@pytest.fixture(autouse=True)
def _interpreted_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted(fmt, "_gate_up_kernel", monkeypatch)
    interpreted(fmt, "_down_kernel", monkeypatch)
    poisoned = lambda *shape, **options: torch.full(shape, float("nan"), **options)  # noqa: E731
    monkeypatch.setattr(fmt, "_empty", poisoned)


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    scores = torch.rand(tokens, experts, generator=gen)
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return weights, ids


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}-h{c[1]}-i{c[2]}-{c[5]}-{c[6]}")
def test_kernel_equals_its_twin(case: tuple) -> None:
    tokens, hidden, inner, experts, top_k, activation, dtype = case
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inner, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inner, generator=gen) / inner**0.5
    bias = torch.randn(experts, 2 * inner, generator=gen) if activation != "silu" else None
    weights, ids = _routing(tokens, experts, top_k, gen)
    reference = fused_moe(
        x.double(), w13.double(), w2.double(), weights.double(), ids, activation,
        1.702, 7.0, None if bias is None else bias.double(),
    )  # fmt: skip

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    args = (cast(x), cast(w13), cast(w2), weights, ids, activation, 1.702, 7.0, cast(bias))
    got = fmt.fused_moe_triton(*args)
    assert got.dtype == dtype and not got.isnan().any()
    assert relative_error(got, reference) < TOLERANCE[dtype]
    assert relative_error(fused_moe(*args), reference) < TOLERANCE[dtype]  # the twin's bound


def test_the_layout_groups_each_experts_assignments_in_whole_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    for tokens, experts, top_k, block in ((1, 8, 2, 16), (37, 6, 3, 16), (200, 4, 2, 64)):
        _, ids = _routing(tokens, experts, top_k, gen)
        rows, block_expert = align_by_expert(ids, experts, block)
        num = tokens * top_k
        assert rows.numel() == aligned_capacity(num, experts, block) == block_expert.numel() * block
        real = rows[rows < num]
        assert sorted(real.tolist()) == list(range(num))  # every assignment exactly once
        flat = ids.reshape(-1)
        for index, expert in enumerate(block_expert.tolist()):
            chunk = rows[index * block : (index + 1) * block]
            chunk = chunk[chunk < num]
            if expert < 0:
                assert chunk.numel() == 0
                continue
            assert (flat[chunk] == expert).all()  # one expert per block
            assert chunk.tolist() == sorted(chunk.tolist())  # token order kept
        used = block_expert[block_expert >= 0]
        assert used.tolist() == sorted(used.tolist())
        assert set(used.tolist()) == set(flat.tolist())


def test_the_tiles_fit_each_architectures_shared_memory() -> None:
    cpu = torch.device("cpu")
    assert moe_tiles(128, 128, cpu, 2).block_m == 16  # decode: 16 tokens x top-8 over 128
    assert moe_tiles(8192, 128, cpu, 2).block_m == 64  # a 1,024-token chunk
    for arch, rows in TABLE.items():
        limit = SHARED_LIMIT.get(arch, DEFAULT_SHARED_LIMIT)
        for _, tiles in rows:
            assert tiles.shared_bytes(2) <= limit, (arch, tiles)  # the table is for 16-bit
    assert SHARED_LIMIT[12] <= 99 * 1024  # GB10 (sm_121)
    # float32 operands (the GPU check's parity run) shrink the tiles until they fit.
    for element in (1, 2, 4):
        for num in (8, 4096):
            tiles = moe_tiles(num, 8, cpu, element)
            assert tiles.shared_bytes(element) <= DEFAULT_SHARED_LIMIT
            assert tiles.num_stages >= 2 and tiles.block_k >= 16


if not IN_PROCESS:

    def test_in_a_fresh_interpreter() -> None:
        run_in_a_fresh_interpreter(__file__)
