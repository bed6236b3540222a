"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of `tp_size` and split into contiguous row ranges; padded
rows are zero and their logits are never sampled (the sampler masks columns past the vocabulary).
With a `weight_format` the table stays packed (GGML blocks, as `layers.linear`): a lookup
dequantizes only the rows it gathers, and the LM head multiplies through `kernels.ggml_linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.linear import weight_param
from dgpp.kernels.ggml_linear import ggml_linear_cpu, ggml_rows_cpu
from dgpp.kernels.linear import LinearFn, LinearPacker


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        parallel: ParallelContext,
        weight_format: str | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight_format = weight_format
        self.padded_vocab_size = -(-vocab_size // parallel.tp_size) * parallel.tp_size
        self.rows_local = self.padded_vocab_size // parallel.tp_size
        self.row_start = parallel.tp_rank * self.rows_local
        self.weight = weight_param(self.rows_local, hidden_size, weight_format)
        self.weight.weight_loader = self.load_rows  # type: ignore[attr-defined]
        # A packed table is uint8: this empty float buffer follows `model.to(dtype)`, so lookups
        # know the activations' dtype.
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.zero_()
        rows = max(0, min(self.rows_local, self.vocab_size - self.row_start))
        param.data[:rows].copy_(loaded.narrow(0, self.row_start, rows))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_format is None:
            return F.embedding(ids, self.weight)
        rows = ggml_rows_cpu(self.weight.index_select(0, ids), self.weight_format, self.hidden_size)
        return rows.to(self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the model's run dtype)."""
        return self.dtype_probe.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self._lookup(input_ids)  # [T, hidden]
        local = input_ids - self.row_start
        outside = (local < 0) | (local >= self.rows_local)
        embedded = self._lookup(local.masked_fill(outside, 0))
        embedded.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(embedded)  # [T, hidden]


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states onto the (padded) vocabulary; every rank computes its vocabulary
    slice and the slices are gathered, so every rank returns the full logits.

    `pack()` keeps the dense weight: with tied embeddings it is also the embedding table."""

    packed: LinearFn | None = None

    def pack(self, packer: LinearPacker, keep_dense: bool = True) -> None:
        """The dense weight always stays: the embedding (when tied) and fp32 logits use it."""
        if self.weight_format is None:
            self.packed = packer(self.weight.detach(), None)

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Logits [N, padded_vocab] for hidden [N, hidden]; `dtype` overrides the compute dtype."""
        if self.weight_format is not None:
            x = hidden if dtype is None else hidden.to(dtype)
            logits = ggml_linear_cpu(x, self.weight, self.weight_format, self.hidden_size)
            return self.parallel.all_gather_last_dim(logits)
        if dtype is not None and dtype != self.weight.dtype:
            logits = F.linear(hidden.to(dtype), self.weight.to(dtype))
        elif self.packed is not None:
            logits = self.packed(hidden)
        else:
            logits = F.linear(hidden, self.weight)  # [N, padded_vocab / tp]
        return self.parallel.all_gather_last_dim(logits)
