"""DeepSeek-V4's manifold-constrained hyper-connections against transformers' modules with the
same random weights: a block's read (input, post, comb), its write of the streams as the decoder
layer does it, and the final head, in float32 and with bfloat16 streams; comb comes out doubly
stochastic."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as reference

from dgpp.engine.layers.mhc import HyperHead, ManifoldHyperConnection

N, H = 4, 32


def _config() -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=H, hc_mult=N, hc_sinkhorn_iters=20, num_hidden_layers=2)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_reads_and_writes_the_streams_as_transformers(dtype: torch.dtype) -> None:
    config = _config()
    theirs = reference.DeepseekV4HyperConnection(config).float()
    _randomise(theirs, seed=1)
    ours = ManifoldHyperConnection(
        N, H, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
    )
    ours.load_state_dict(theirs.state_dict())
    streams = torch.randn(5, N, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    post, comb, collapsed = theirs(streams[None])
    got_collapsed, got_post, got_comb = ours.read(streams)
    torch.testing.assert_close(got_collapsed, collapsed[0])
    torch.testing.assert_close(got_post, post[0])
    torch.testing.assert_close(got_comb, comb[0])
    ones = torch.ones(5, N)
    torch.testing.assert_close(got_comb.sum(-2), ones, atol=1e-4, rtol=0)  # columns
    torch.testing.assert_close(got_comb.sum(-1), ones, atol=1e-2, rtol=0)  # rows, near
    out = torch.randn(5, H).to(dtype)
    # the decoder layer's update, as DeepseekV4DecoderLayer writes it
    want = post[0].to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb[0].to(dtype).transpose(-1, -2), streams
    )
    torch.testing.assert_close(
        ManifoldHyperConnection.write(streams, out, got_post, got_comb), want
    )


def test_the_head_reads_as_transformers() -> None:
    config = _config()
    theirs = reference.DeepseekV4HyperHead(config).float()
    _randomise(theirs, seed=3)
    ours = HyperHead(N, H, config.hc_eps, config.rms_norm_eps)
    ours.load_state_dict(theirs.state_dict())
    streams = torch.randn(7, N, H)
    torch.testing.assert_close(ours(streams), theirs(streams[None])[0])
