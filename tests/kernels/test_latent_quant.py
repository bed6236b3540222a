"""Quantized token-row caches (`kernels.latent_quant`): MLA latents and a sparse indexer's keys.
The row layout (the latent's bytes are `kv_quant`'s blocks exactly, the rope key's are the
model dtype's own, FlashMLA's 656 bytes at fp8 for DeepSeek's 512 + 64); and every reader (the
MLA backend's decode, verify and prefill rows, DSA's top-k selection and its sparse attention)
over a quantized cache equals the same reader over a model-dtype cache that holds the rows'
dequantized values."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.backends.cache_spec import IndexerKeySpec, MLALatentSpec
from dgpp.engine.backends.sparse_mla import SparseMLAAttention
from dgpp.engine.backends.torch_mla import TorchMLAAttention
from dgpp.kernels.kv_quant import kv_format
from dgpp.kernels.latent_quant import row_format, store_rows
from tests.kernels.test_sparse_mla import (
    INDEX_DIM,
    NUM_DECODES,
    RANK,
    ROPE,
    ROWS,
    SCALE,
    _inputs,
    _metadata,
)

KV_DTYPES = ["int8", "fp8_e4m3", "int4"]
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("kv_dtype", "dtype", "width"),
    [("int8", torch.bfloat16, 672), ("fp8_e4m3", torch.bfloat16, 656),
     ("int4", torch.bfloat16, 416), ("int8", torch.float32, 800)],
    ids=str,
)  # fmt: skip
def test_a_deepseek_latent_row(kv_dtype: str, dtype: torch.dtype, width: int) -> None:
    """512 latent values in blocks, 64 rope values in the model dtype, 16-byte aligned."""
    fmt = row_format(kv_dtype, 512, 64)
    assert fmt is not None and fmt.width(dtype) == width
    spec = MLALatentSpec(512, 64, kv_dtype)
    assert spec.bytes_per_token(dtype) == width
    assert spec.allocate(2, 3, 4, dtype, CPU).shape == (2, 3, 4, width)
    rows = torch.randn(5, 576, generator=torch.Generator().manual_seed(0)).to(dtype)
    encoded = fmt.encode(rows)
    codes = kv_format(kv_dtype, 512)
    assert torch.equal(encoded[:, : codes.width], codes.encode(rows[:, :512]))
    rope = encoded[:, fmt.codes_bytes : fmt.codes_bytes + 64 * dtype.itemsize]
    assert torch.equal(rope, rows[:, 512:].contiguous().view(torch.uint8))
    assert not encoded[:, codes.width : fmt.codes_bytes].any()  # the padding
    decoded = fmt.decode(encoded, dtype)
    assert torch.equal(decoded[:, 512:], rows[:, 512:])  # the rope key exactly
    assert torch.equal(decoded[:, :512], codes.decode(codes.encode(rows[:, :512]), dtype))


def test_auto_is_no_format_and_int4_indexer_keys_are_8_bit() -> None:
    assert row_format("auto", 512, 64) is None
    assert MLALatentSpec(512, 64).bytes_per_token(torch.bfloat16) == 1152
    assert IndexerKeySpec(128, "int4").row_format == row_format("int8", 128)
    assert IndexerKeySpec(128, "fp8_e4m3").bytes_per_token(torch.bfloat16) == 144  # 130 aligned


def _quantized(cache: torch.Tensor, kv_dtype: str, kept: int) -> tuple[torch.Tensor, ...]:
    """cache [blocks, block, C] float32 -> (its quantized rows, their dequantized values)."""
    fmt = row_format(kv_dtype, cache.shape[-1] - kept, kept)
    stored = fmt.encode(cache.flatten(0, 1)).view(*cache.shape[:2], -1)
    return stored, fmt.decode(stored, cache.dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_mla_backend_reads_what_the_dequantized_cache_holds(kv_dtype: str) -> None:
    """Decode, verify and prefill rows in one step; the step's own latents stored quantized
    first (the auto side stores their round trip)."""
    _, latents, _, _, q_nope, q_pe, kv_b = (x.float() for x in _inputs(1))
    step_latents = torch.randn(q_nope.shape[0], RANK + ROPE, generator=torch.Generator())
    stored, values = _quantized(latents, kv_dtype, ROPE)
    fmt = row_format(kv_dtype, RANK, ROPE)
    metadata = _metadata(ROWS, NUM_DECODES)
    quantized = TorchMLAAttention(CPU, kv_dtype)
    got = quantized.forward(q_nope, q_pe, step_latents, stored, kv_b, metadata, SCALE)
    round_trip = fmt.decode(fmt.encode(step_latents), torch.float32)
    plain = TorchMLAAttention(CPU)
    want = plain.forward(q_nope, q_pe, round_trip, values.clone(), kv_b, metadata, SCALE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    written = torch.zeros_like(stored)
    store_rows(step_latents, written, metadata.slot_mapping, fmt)
    assert torch.equal(written.view(-1, written.shape[-1])[metadata.slot_mapping], stored.view(
        -1, stored.shape[-1])[metadata.slot_mapping])  # fmt: skip


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_dsa_selects_and_attends_over_quantized_keys_and_latents(kv_dtype: str) -> None:
    keys, latents, q, weights, q_nope, q_pe, kv_b = (x.float() for x in _inputs(2))
    tokens = q.shape[0]
    gen = torch.Generator().manual_seed(3)
    step_keys = torch.randn(tokens, INDEX_DIM, generator=gen)
    step_latents = torch.randn(tokens, RANK + ROPE, generator=gen)
    key_fmt = IndexerKeySpec(INDEX_DIM, kv_dtype).row_format
    latent_fmt = row_format(kv_dtype, RANK, ROPE)
    stored_keys = key_fmt.encode(keys.flatten(0, 1)).view(*keys.shape[:2], -1)
    stored_latents, latent_values = _quantized(latents, kv_dtype, ROPE)
    metadata = _metadata(ROWS, NUM_DECODES)
    topk = 6
    sparse = SparseMLAAttention(TorchMLAAttention(CPU, kv_dtype))
    chosen = sparse.select(q, weights, step_keys, stored_keys, metadata, topk, 0.3)
    got = sparse.forward(q_nope, q_pe, step_latents, stored_latents, kv_b, metadata, SCALE, chosen)
    plain = SparseMLAAttention(TorchMLAAttention(CPU))
    key_values = key_fmt.decode(stored_keys, torch.float32)
    step_key_values = key_fmt.decode(key_fmt.encode(step_keys), torch.float32)
    expected = plain.select(q, weights, step_key_values, key_values, metadata, topk, 0.3)
    assert chosen is not None and expected is not None
    assert torch.equal(chosen.positions, expected.positions)
    round_trip = latent_fmt.decode(latent_fmt.encode(step_latents), torch.float32)
    want = plain.forward(q_nope, q_pe, round_trip, latent_values, kv_b, metadata, SCALE, expected)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
