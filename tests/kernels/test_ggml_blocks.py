"""Every GGML block dequantizer equals gguf-py's reference bit for bit, on random blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from dgpp.kernels.ggml_blocks import FORMATS, dequantize

# Byte ranges of each block's float16 scales: set to finite values (random bytes would make
# NaN and infinity scales, whose payloads say nothing about the layout).
SCALES = {
    "Q4_0": [(0, 2)],
    "Q4_1": [(0, 2), (2, 4)],
    "Q5_0": [(0, 2)],
    "Q5_1": [(0, 2), (2, 4)],
    "Q8_0": [(0, 2)],
    "Q4_K": [(0, 2), (2, 4)],
    "Q5_K": [(0, 2), (2, 4)],
    "Q6_K": [(208, 210)],
}


def _random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    fmt = FORMATS[name]
    if fmt.block_size == 1:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * 3
        if name == "F16":
            return values.astype(np.float16).view(np.uint8)
        if name == "BF16":
            return quants.quantize(values, GGMLQuantizationType.BF16)
        return values.view(np.uint8)
    blocks = rng.integers(0, 256, (rows * cols // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for start, end in SCALES[name]:
        scales = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, start:end] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_equals_gguf_py_bit_for_bit(name: str) -> None:
    rng = np.random.default_rng(7)
    fmt = FORMATS[name]
    rows, cols = 6, 2 * max(fmt.block_size, 32)
    raw = _random_blocks(name, rows, cols, rng)
    expected = quants.dequantize(raw, GGMLQuantizationType(fmt.ggml_type)).astype(np.float32)
    got = dequantize(torch.from_numpy(raw.copy()), fmt, (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(expected).view(torch.int32))


def test_a_wrong_byte_count_names_the_format_and_shape() -> None:
    fmt = FORMATS["Q4_1"]
    with pytest.raises(ValueError, match=r"Q4_1 tensor of shape \(2, 64\) needs 80 bytes, has 79"):
        dequantize(torch.zeros(79, dtype=torch.uint8), fmt, (2, 64))
    with pytest.raises(ValueError, match="whole 32-weight blocks"):
        dequantize(torch.zeros(20, dtype=torch.uint8), fmt, (1, 16))
