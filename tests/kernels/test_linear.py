"""Packed matmul kernels agree with `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpp.kernels.linear import onednn_usable, pack_onednn, select_packer

CPU = torch.device("cpu")


@pytest.mark.skipif(not onednn_usable(CPU, torch.float32), reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_packed_linear_matches_torch_twin(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 40, generator=generator)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(pack_onednn(weight, bias)(x), expected, atol=1e-4, rtol=1e-5)


def test_packer_selection() -> None:
    assert select_packer(CPU, torch.bfloat16) is None  # only float32 weights are prepacked
    assert select_packer(torch.device("cuda"), torch.float32) is None
    expected = pack_onednn if onednn_usable(CPU, torch.float32) else None
    assert select_packer(CPU, torch.float32) is expected
