"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual stream kept as
`hc_mult` streams [T, N, H], each block reading a weighted sum of them and writing its output
back into every stream, with the streams themselves mixed by a doubly-stochastic matrix.

Per block, from the streams flattened and RMS-normalised (no weight) over N * H in float32:

    [p | q | c] = normed @ fn^T                       (N, N and N * N values per token)
    pre  = sigmoid(p * scale_0 + base_p) + eps        read: x_in = sum_n pre_n x_n
    post = 2 sigmoid(q * scale_1 + base_q)            write weight of the block's output
    comb = softmax_rows(c * scale_2 + base_c) + eps,  then Sinkhorn: columns, then
           (rows, columns) `hc_sinkhorn_iters - 1` times, each sum + eps in the denominator
    streams' = post_n * out + sum_j comb[j, n] x_j     (comb transposed: its columns sum to 1)

The model starts with N copies of the embedding and ends with `HyperHead`: one more read (its own
pre weights, no write) before the final norm. Replicated on every rank (fn is
[(2 + N) N, N H]: small beside the blocks it feeds).
"""

from __future__ import annotations

import torch
from torch import nn


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


def _normed(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, N, H] flattened and RMS-normalised in float32, [T, N * H]."""
    flat = streams.flatten(1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class ManifoldHyperConnection(nn.Module):
    """One block's read and write of the streams (`attn_hc` / `ffn_hc`)."""

    def __init__(self, streams: int, hidden: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.streams, self.iters, self.eps, self.norm_eps = streams, sinkhorn_iters, eps, norm_eps
        width = (2 + streams) * streams
        self.fn = _param(width, streams * hidden)
        self.base = _param(width)
        self.scale = _param(3)

    def read(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the block's input [T, H] in the streams' dtype, post [T, N], comb [T, N, N])."""
        n = self.streams
        mixes = _normed(streams, self.norm_eps) @ self.fn.float().t()
        p, q, c = mixes.split([n, n, n * n], dim=-1)
        base_p, base_q, base_c = self.base.float().split([n, n, n * n])
        scale = self.scale.float()
        pre = torch.sigmoid(p * scale[0] + base_p) + self.eps
        post = 2 * torch.sigmoid(q * scale[1] + base_q)
        comb = torch.softmax((c * scale[2] + base_c).view(-1, n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def write(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The streams after a block whose output is out [T, H]."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The last read of the streams, in place of a block (`hc_head`)."""

    def __init__(self, streams: int, hidden: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = _param(streams, streams * hidden)
        self.hc_base = _param(streams)
        self.hc_scale = _param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = _normed(streams, self.norm_eps) @ self.hc_fn.float().t()
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
