"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of `tp_size` and split into contiguous row ranges; padded
rows are zero and their logits are never sampled (the sampler masks columns past the vocabulary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.parallel import ParallelContext
from dgpp.kernels.linear import LinearFn, LinearPacker


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.padded_vocab_size = -(-vocab_size // parallel.tp_size) * parallel.tp_size
        self.rows_local = self.padded_vocab_size // parallel.tp_size
        self.row_start = parallel.tp_rank * self.rows_local
        self.weight = nn.Parameter(torch.empty(self.rows_local, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.load_rows  # type: ignore[attr-defined]

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.zero_()
        rows = max(0, min(self.rows_local, self.vocab_size - self.row_start))
        param.data[:rows].copy_(loaded.narrow(0, self.row_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [T, hidden]
        local = input_ids - self.row_start
        outside = (local < 0) | (local >= self.rows_local)
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        embedded.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(embedded)  # [T, hidden]


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states onto the (padded) vocabulary; every rank computes its vocabulary
    slice and the slices are gathered, so every rank returns the full logits.

    `pack()` keeps the dense weight: with tied embeddings it is also the embedding table."""

    packed: LinearFn | None = None

    def pack(self, packer: LinearPacker, keep_dense: bool = True) -> None:
        """The dense weight always stays: the embedding (when tied) and fp32 logits use it."""
        self.packed = packer(self.weight.detach(), None)

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Logits [N, padded_vocab] for hidden [N, hidden]; `dtype` overrides the compute dtype."""
        if dtype is not None and dtype != self.weight.dtype:
            logits = F.linear(hidden.to(dtype), self.weight.to(dtype))
        elif self.packed is not None:
            logits = self.packed(hidden)
        else:
            logits = F.linear(hidden, self.weight)  # [N, padded_vocab / tp]
        return self.parallel.all_gather_last_dim(logits)
