"""Top-k with a rule for ties: the sparse indexers' choice (DSA's tokens, DeepSeek-V4's
compressed windows, QSA's blocks) is a function of a query's context alone.

Indexer scores tie exactly where every head's ReLU is zero, which is common with few indexer
heads or negative head weights; then the last places of the budget fall among equal scores.
`torch.topk` on the CPU picks among them in its selection algorithm's order, which moves with
the row's length: a prompt chunked otherwise, resumed from the prefix cache, or scored in a
decode or verify row chose other keys and gave other logits (issue 62: 0.6 to 2 in logprob).
Here the earliest positions among the keys tied at the cut are kept: the first `k` of a stable
descending sort, whatever follows them in the row (keys out of reach score -inf).
"""

from __future__ import annotations

import torch


def topk_earliest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices [Q, k] of each row's `k` largest scores [Q, S] (k <= S), the earliest
    positions among those tied at the k-th value, in increasing order. Two top-k passes and a
    scan, no host sync (CUDA-graph safe): the k-th value, then the positions above it and the
    first tied ones."""
    if k == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.int64, device=scores.device)
    kth = scores.topk(k, dim=-1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    wanted = k - above.sum(dim=-1, keepdim=True, dtype=torch.int32)
    kept = above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= wanted))
    # exactly k kept per row: rank them by position (earlier higher), the rest 0
    width = scores.shape[-1]
    earlier = torch.arange(width, 0, -1, dtype=torch.int32, device=scores.device)
    return (kept * earlier).topk(k, dim=-1).indices
