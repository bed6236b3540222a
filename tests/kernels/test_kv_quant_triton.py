"""The Triton paged-attention kernels over quantized KV rows (`kernels.kv_quant_triton`), under
Triton's interpreter (tests/conftest.py): decode rows, split-K decode, verify rows and prefill
chunks with a window or sinks, each equal to the PyTorch twin over the same quantized caches up
to float32 summation order."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.backends.triton_paged import TritonPagedAttention
from dgpp.kernels.kv_quant import kv_format
from dgpp.kernels.paged_attention_torch import paged_attention, store_kv
from dgpp.kernels.paged_attention_triton import paged_attention_triton
from tests.kernels.test_kv_quant import paged_step

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize(
    ("rows", "decodes", "partition", "window", "sinks"),
    [
        ([(23, 1), (37, 1)], 2, 512, None, False),
        ([(150, 1)], 1, 32, None, False),  # split-K
        ([(30, 3), (45, 20)], 1, 512, 11, False),  # a verify row and a chunk, windowed
        ([(40, 1), (33, 17)], 1, 512, None, True),  # sinks
    ],
    ids=["decode", "split-k", "verify-chunk-window", "chunk-sinks"],
)
def test_the_kernels_read_quantized_rows_as_the_twin(
    name: str, rows: list, decodes: int, partition: int, window: int | None, sinks: bool
) -> None:
    heads, kv_heads, dim, block = 4, 2, 64, 8
    fmt = kv_format(name, dim)
    layout, blocks = paged_step(rows, decodes, block)
    gen = torch.Generator().manual_seed(7)
    tokens = blocks * block
    key, value = (torch.randn(tokens, kv_heads, dim, generator=gen) for _ in range(2))
    packed = torch.zeros(2, blocks, block, kv_heads, fmt.width, dtype=torch.uint8)
    store_kv(key, value, packed[0], packed[1], torch.randperm(tokens, generator=gen), fmt)
    twin_metadata = TorchPagedAttention(CPU).prepare(layout)
    metadata = TritonPagedAttention(CPU).prepare(layout)
    query = torch.randn(twin_metadata.query_start_loc_host[-1], heads, dim, generator=gen)
    sink = torch.randn(heads, generator=gen) if sinks else None
    want = paged_attention(query, packed[0], packed[1], twin_metadata, 0.15, sink, window, kv=fmt)
    got = paged_attention_triton(
        query, packed[0], packed[1], metadata, 0.15, sink, window, partition_keys=partition,
        kv=fmt,
    )  # fmt: skip
    assert float((got - want).abs().max()) < 1e-5
