"""The compiled CPU paged-attention kernel (kernels/cpu/paged_attention.cpp) equals its PyTorch
twin (`paged_attention_torch.paged_attention`) on mixed steps: decode rows, verify rows, chunks
deep in a context and whole prompts, scattered block tables, lengths that end mid-block,
query-head groups of 1 to 8, head dims of 64, 80 and 128, key spans split across threads and not;
sinks and windows that exclude keys take the twin."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.decode_inputs import decode_gather_inputs, decode_query_index
from dgpp.kernels.paged_attention_cpu import cpu_extension, kernel_applies, paged_attention_cpu
from dgpp.kernels.paged_attention_torch import paged_attention


@pytest.fixture(scope="module", autouse=True)
def extension() -> object:
    ext = cpu_extension()
    if ext is None:
        pytest.fail("the paged attention CPU kernel did not build (a C++ compiler and ninja)")
    return ext


def _step(
    rows: list[tuple[int, int]],
    num_decodes: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """Random caches filled for every row's (seq_len, query_len), scattered tables."""
    generator = torch.Generator().manual_seed(seed)
    need = sum(-(-seq_len // block) for seq_len, _ in rows)
    num_blocks = need + 7
    key_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator)
    value_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[free.pop() for _ in range(-(-seq_len // block))] for seq_len, _ in rows]
    starts = [0]
    for _, q_len in rows:
        starts.append(starts[-1] + q_len)
    seq_lens = [seq_len for seq_len, _ in rows]
    width = max(len(t) for t in tables)
    cpu = torch.device("cpu")
    query_lens = [q_len for _, q_len in rows[:num_decodes]]
    decode_slots, decode_mask = (
        decode_gather_inputs(tables[:num_decodes], seq_lens[:num_decodes], block, cpu, query_lens)
        if num_decodes
        else (None, None)
    )
    index = decode_query_index(query_lens, cpu) if num_decodes else None
    metadata = PagedAttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc_host=tuple(starts),
        seq_lens_host=tuple(seq_lens),
        num_decodes=num_decodes,
        max_seq_len=max(seq_lens),
        prefill_softmax_fp32=True,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        decode_query_index=index[0] if index else None,
        decode_output_index=index[1] if index else None,
    )
    query = torch.randn(starts[-1], heads, dim, generator=generator)
    return query, key_cache, value_cache, metadata


SHAPES = {
    # heads, kv heads, head dim, block size
    "default-model": (9, 3, 64, 16),
    "mha": (4, 4, 64, 16),
    "group-8": (16, 2, 128, 16),
    "dim-80": (6, 2, 80, 32),
}
STEPS = {
    # (seq_len, query_len) rows; leading decode rows
    "deep-short-chunk": ([(1500, 16)], 0),
    "chunks-and-prompts": ([(37, 37), (300, 61), (17, 1), (129, 100)], 0),
    "decode-beside-chunks": ([(40, 1), (77, 1), (700, 33)], 2),
    "decode-only": ([(40, 1), (1300, 1), (9, 1), (260, 1)], 4),
    "verify-rows": ([(50, 3), (301, 1), (18, 5), (90, 90)], 3),
    "one-token-chunk": ([(5, 1), (64, 64)], 0),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("step", sorted(STEPS))
def test_kernel_equals_the_twin(extension: object, shape: str, step: str) -> None:
    heads, kv_heads, dim, block = SHAPES[shape]
    rows, num_decodes = STEPS[step]
    query, key_cache, value_cache, metadata = _step(
        rows, num_decodes, heads, kv_heads, dim, block, seed=len(step) + heads
    )
    scale = dim**-0.5
    assert kernel_applies(query, key_cache, None)
    expected = paged_attention(query, key_cache, value_cache, metadata, scale)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    out = torch.full_like(query, float("nan"))
    assert paged_attention_cpu(query, key_cache, value_cache, metadata, scale, out=out) is out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)
    # The compiled entry point itself, not only the wrapper that may route to the twin.
    direct = torch.full_like(query, float("nan"))
    extension.paged_attention(  # type: ignore[attr-defined]
        query,
        key_cache,
        value_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale,
        direct,
        0,  # a float32 cache (KvKind: decode_attention.h)
    )
    torch.testing.assert_close(direct, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_key_spans_merge_exactly(threads: int) -> None:
    """One tile over a long context: its keys split across threads (more threads, more spans)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        query, key_cache, value_cache, metadata = _step([(2900, 5)], 0, 9, 3, 64, 16, seed=4)
        expected = paged_attention(query, key_cache, value_cache, metadata, 0.125)
        got = paged_attention_cpu(query, key_cache, value_cache, metadata, 0.125)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


def test_large_scores_stay_finite() -> None:
    """Scores far apart (a sharp softmax) neither overflow nor lose the winning key."""
    query, key_cache, value_cache, metadata = _step([(90, 30)], 0, 4, 2, 64, 16, seed=2)
    query = query * 40
    expected = paged_attention(query, key_cache, value_cache, metadata, 1.0)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_sinks_windows_and_other_dtypes_take_the_twin() -> None:
    query, key_cache, value_cache, metadata = _step([(40, 12), (50, 50)], 0, 4, 2, 64, 16, seed=3)
    sinks = torch.randn(4)
    assert not kernel_applies(query, key_cache, sinks)
    expected = paged_attention(query, key_cache, value_cache, metadata, 0.125, sinks)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, 0.125, sinks)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # A window shorter than a row excludes keys: the step is the twin's.
    expected = paged_attention(query, key_cache, value_cache, metadata, 0.125, None, 45)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, 0.125, None, 45)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    half = query.bfloat16()
    assert not kernel_applies(half, key_cache.bfloat16(), None)


def test_cpu_float32_models_get_the_kernel_backend() -> None:
    from dgpp.engine.backends.cpu_paged import CpuPagedAttention
    from dgpp.engine.backends.selection import select_attention_backend
    from dgpp.engine.backends.torch_paged import TorchPagedAttention

    cpu = torch.device("cpu")
    assert type(select_attention_backend(cpu, torch.float32)) is CpuPagedAttention
    assert type(select_attention_backend(cpu, torch.bfloat16)) is TorchPagedAttention
