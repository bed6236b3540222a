"""DeepSeek-V4's lightning indexer: which compressed sparse keys each query attends to.

It compresses the same windows as the layer's compressed sparse keys into keys of its own
(`index_head_dim`, overlapping windows: `WindowCompressor`, whose parameters it holds under the
same names), and scores query p against key w as

    score(p, w) = sum_h w_h(x_p) * relu(q_h(p) . k_w) / sqrt(index_head_dim)

with q = rope(q_b_proj(q latent)) per indexer head (no norm) and the head weights
`weights_proj(x) / sqrt(index_n_heads)`, in float32. Only keys of windows closed by p
(w < (p + 1) // rate) are candidates; the `index_topk` best are chosen, -1 filling the places of
a query with fewer candidates (docs/deepseek_v4.md, section 4). Replicated on every rank.

Scores tie exactly where every head's ReLU is zero (common with few indexer heads, or when the
head weights are negative). A row holds the keys closed by the end of its chunk, so left to
`torch.topk` (whose choice among equal values moves with the row's length on the CPU) a
query's choice changed with the chunk size, a decode step or a prefix hit. Ties at the edge of
the budget go to the lowest-indexed (oldest) windows (`dgpp.kernels.topk_ties`).
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.engine.layers.deepseek_v4_parts import rotate_trailing_pairs
from dgpp.engine.layers.mla import RowSliceLinear
from dgpp.engine.layers.rotary import RotaryEmbedding
from dgpp.engine.layers.window_compressor import WindowCompressor
from dgpp.kernels.topk_ties import topk_earliest

# The per-head scores [queries, heads, keys] are made this many float32 values at a time (256
# MiB): a 1M-token context has 262,144 compressed keys, 64 indexer heads and 256-query blocks.
SCORE_ELEMENTS = 1 << 26


class IndexerScorer(nn.Module):
    """`weights_proj`: the per-head weights of the scores."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = RowSliceLinear(hidden, (0, heads), bias=False)


class LightningIndexer(WindowCompressor):
    def __init__(
        self, hidden: int, q_rank: int, heads: int, dim: int, rate: int, topk: int, eps: float
    ) -> None:
        super().__init__(hidden, dim, rate, overlap=True, eps=eps)
        self.heads, self.topk = heads, topk
        self.q_b_proj = RowSliceLinear(q_rank, (0, heads * dim), bias=False)
        self.scorer = IndexerScorer(hidden, heads)

    def scores(
        self,
        hidden: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """score [S, T] of queries (hidden [S, H], q latent [S, q_rank], positions [S]) against
        the indexer keys [T, dim]; -inf where a key's window is not closed yet."""
        q = self.q_b_proj(q_latent).view(-1, self.heads, self.dim)
        q = rotate_trailing_pairs(q, rotary.lookup(positions, q.dtype)).float()
        weights = self.scorer.weights_proj(hidden).float() * self.heads**-0.5  # [S, heads]
        score = q.new_empty(q.shape[0], keys.shape[0])
        step = max(1, SCORE_ELEMENTS // (q.shape[0] * self.heads))  # keys at a time
        for first in range(0, keys.shape[0], step):
            part = keys[first : first + step].float()
            relu = torch.relu(torch.einsum("shd,td->sht", q, part)) * self.dim**-0.5
            score[:, first : first + step] = torch.einsum("sht,sh->st", relu, weights)
        closed = (positions + 1) // self.rate  # [S]: windows closed by each query
        future = torch.arange(keys.shape[0], device=keys.device)[None] >= closed[:, None]
        return score.masked_fill(future, float("-inf"))

    def select(self, score: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The chosen keys [S, min(topk, T)] of `scores`, -1 where a query has fewer; ties at
        the budget's edge to the lowest index (the module's docstring)."""
        chosen = topk_earliest(score, min(self.topk, score.shape[1]))
        closed = ((positions + 1) // self.rate).unsqueeze(-1)
        return torch.where(chosen >= closed, torch.full_like(chosen, -1), chosen)
