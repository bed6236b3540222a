"""DeepSeek-V4's attention layer (docs/deepseek_v4.md): one shared key per token that is also
its value, queries from a low-rank latent, a sink per head, and by layer kind

- sliding: the last `window` keys (the query's own included);
- heavily compressed (rate 128): those, plus one pooled key per closed window of `rate` tokens;
- compressed sparse (rate 4, overlapping windows): the window keys plus the `index_topk`
  compressed keys a lightning indexer picks for each query, gathered, never masked densely.

All of them in one softmax with the sink. The window's keys and the compressors' carries are a
per-request state (`v4_state`); the compressed keys (and the indexer's) are paged by block
(`compressed_keys`). The rope dims are the trailing ones, in pairs, and turned back at the
query's position on the output (keys are values).

Tensor parallel: the query heads (with their sinks and whole output groups) split over the
ranks; the query latent, the key projection, the compressors and the indexer replicated (every
head reads the same keys and selection). Rows run one by one on the host: a first version,
exact against transformers, with no fused kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import BatchLayout, StepMetadata
from dgpp.engine.backends.state_cache import LinearStateBackend, StateSlotLayer
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers import state_rows
from dgpp.engine.layers.attention import PagedAttention
from dgpp.engine.layers.compressed_keys import CompressedKeys, LayoutBackend
from dgpp.engine.layers.deepseek_v4_parts import GroupedOutputProjection, rotate_trailing_pairs
from dgpp.engine.layers.linear import ColumnParallelLinear
from dgpp.engine.layers.mla import RowSliceLinear
from dgpp.engine.layers.norm import RMSNorm
from dgpp.engine.layers.rotary import RopeAngles, RotaryEmbedding
from dgpp.engine.layers.v4_config import CSA, V4Dims
from dgpp.engine.layers.v4_indexer import LightningIndexer
from dgpp.engine.layers.v4_state import CarrySpec, V4StateSpec
from dgpp.engine.layers.window_compressor import WindowCompressor

QUERY_BLOCK = 256  # a prefill chunk's queries attended at a time (bounds the scores' memory)


@dataclass(frozen=True)
class Rotary:
    """The compress rotary table, held by reference (not a submodule of every layer)."""

    table: RotaryEmbedding


def v4_state_spec(dims: V4Dims, index: int, kv_dtype: str = "auto") -> V4StateSpec:
    """Layer `index`'s state slot on any rank (everything in it is replicated), its window's
    keys at `kv_dtype`."""
    rate, dim = dims.rate(index), dims.head_dim
    carries: tuple[CarrySpec, ...] = ()
    if rate and dims.layer_types[index] == CSA:
        carries = (
            CarrySpec(rate, 2 * dim, dim),
            CarrySpec(rate, 2 * dims.index_dim, dims.index_dim),
        )
    elif rate:
        carries = (CarrySpec(rate, dim),)
    return V4StateSpec(dim, dims.window - 1, carries, dims.rope_dim, kv_dtype)


class V4Projections(nn.Module):
    """The query, key and output projections every V4 attention layer has, under
    transformers' `DeepseekV4Attention` names (the output projection's under `output`)."""

    load_sinks = PagedAttention.load_sinks

    def __init__(
        self,
        dims: V4Dims,
        index: int,
        parallel: ParallelContext,
        config: ModelConfig | None = None,
        own_sinks: bool = True,
    ) -> None:
        """`config`: how the checkpoint stores the query and output projections (FP8 kept
        packed); the others are kept dense (dequantized at load). `own_sinks`: the sinks are
        a parameter here (else the paged attention's)."""
        super().__init__()
        prefix = f"model.layers.{index}.self_attn"

        def format_of(names: list[str], cols: int, start: int = 0, total: int = 0) -> Any:
            return config.weight_format(names, cols, start, total) if config else None

        hidden, dim, eps = dims.hidden, dims.head_dim, dims.eps
        self.num_heads = parallel.shard(dims.heads, "num_attention_heads")
        self.first_head = parallel.tp_rank * self.num_heads
        self.head_dim, self.eps, self.scale = dim, eps, dim**-0.5
        self.q_a_proj = RowSliceLinear(hidden, (0, dims.q_rank), bias=False)
        self.q_a_norm = RMSNorm(dims.q_rank, eps)
        self.q_b_proj = ColumnParallelLinear(
            dims.q_rank,
            dims.heads * dim,
            False,
            parallel,
            format_of([f"{prefix}.q_b_proj"], dims.q_rank),
        )
        self.kv_proj = RowSliceLinear(hidden, (0, dim), bias=False)
        self.kv_norm = RMSNorm(dim, eps)
        if own_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            self.sinks.weight_loader = self.load_sinks  # type: ignore[attr-defined]
        self.output = GroupedOutputProjection(
            dims.heads,
            dim,
            dims.o_groups,
            dims.o_rank,
            hidden,
            parallel,
            partial(format_of, [f"{prefix}.output.o_b_proj"]),
        )

    def project(
        self, angles: RopeAngles, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, H, D], the query latent [T, q_rank], the key kv [T, D]), rotated."""
        tokens = hidden.shape[0]
        latent = self.q_a_norm(self.q_a_proj(hidden))
        q = self.q_b_proj(latent).view(tokens, self.num_heads, self.head_dim)
        factor = torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps)
        q = rotate_trailing_pairs(q * factor.to(q.dtype), angles)  # per-head, unweighted
        kv = self.kv_norm(self.kv_proj(hidden))
        return q, latent, rotate_trailing_pairs(kv[:, None], angles)[:, 0]

    def finish(self, out: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
        """The heads' outputs [T, H, D] turned back at the queries' positions, projected."""
        out = rotate_trailing_pairs(out, angles, inverse=True)
        return self.output(out.reshape(out.shape[0], -1))


class PagedV4Attention(V4Projections):
    """A sliding V4 layer whose window keys are paged (the MTP layer's: its drafts' keys are
    overwritten by position when rejected, as any paged key is): one key head, the key its own
    value, the paged backend's sliding window and sinks."""

    def __init__(
        self,
        dims: V4Dims,
        index: int,
        parallel: ParallelContext,
        backend: Any,
        config: ModelConfig | None = None,
    ) -> None:
        super().__init__(dims, index, parallel, config, own_sinks=False)
        self.rate = 0
        self.attn = PagedAttention(
            self.num_heads,
            1,
            dims.head_dim,
            self.scale,
            backend,
            has_sinks=True,
            sliding_window=dims.window,
            first_head=self.first_head,
        )

    def forward(
        self, angles: RopeAngles, hidden: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        q, _, kv = self.project(angles, hidden)
        return self.finish(self.attn(q, kv[:, None], kv[:, None], metadata), angles)


class V4Attention(V4Projections, StateSlotLayer):
    """The layer as the model serves it: window and carries a state slot, pooled keys paged."""

    def __init__(
        self,
        dims: V4Dims,
        index: int,
        parallel: ParallelContext,
        backends: tuple[LinearStateBackend, LayoutBackend],
        rotary: Rotary,
        config: ModelConfig | None = None,
    ) -> None:
        super().__init__(dims, index, parallel, config)
        state_backend, layout_backend = backends
        hidden, dim, eps = dims.hidden, dims.head_dim, dims.eps
        self.rate = dims.rate(index)
        self.compressor: WindowCompressor | None = None
        self.keys: CompressedKeys | None = None
        self.index_keys: CompressedKeys | None = None
        if self.rate:
            sparse = dims.layer_types[index] == CSA
            self.compressor = WindowCompressor(hidden, dim, self.rate, sparse, eps)
            self.keys = CompressedKeys(dim, self.rate, layout_backend, dims.rope_dim)
            if sparse:
                indexer = LightningIndexer(
                    hidden,
                    dims.q_rank,
                    dims.index_heads,
                    dims.index_dim,
                    self.rate,
                    dims.index_topk,
                    eps,
                )
                self.compressor.add_module("indexer", indexer)  # transformers' place for it
                self.index_keys = CompressedKeys(
                    dims.index_dim, self.rate, layout_backend, index=True
                )
        self.init_state(v4_state_spec(dims, index, state_backend.kv_dtype), state_backend)
        self._layout, self._rotary = layout_backend, rotary

    @property
    def indexer(self) -> LightningIndexer | None:
        return getattr(self.compressor, "indexer", None)

    def forward(
        self, angles: RopeAngles, hidden: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        layout: BatchLayout = metadata[self._layout.name]
        q, latent, kv = self.project(angles, hidden)
        out = torch.empty_like(q)
        at = 0
        for number, row in enumerate(layout.rows):
            n, slot = row.num_tokens, row.state_slot
            if number < layout.num_decodes and n > 1:  # a verify row: a state per position
                draft = self._backend.layout
                assert draft is not None, "verify rows need the runner's draft slots"
                for j in range(n):
                    reads = draft.draft_slot(slot, j - 1) if j else slot
                    writes = slot if j == n - 1 else draft.draft_slot(slot, j)
                    span = slice(at + j, at + j + 1)
                    parts = (hidden[span], q[span], latent[span], kv[span])
                    out[span] = self._row(*parts, row.start + j, row.block_table, reads, writes)
            else:
                span = slice(at, at + n)
                parts = (hidden[span], q[span], latent[span], kv[span])
                out[span] = self._row(*parts, row.start, row.block_table, slot, slot)
            at += n
        return self.finish(out, angles)

    def _row(
        self,
        hidden: torch.Tensor,
        q: torch.Tensor,
        latent: torch.Tensor,
        kv: torch.Tensor,
        start: int,
        table: Sequence[int],
        reads: int,
        writes: int,
    ) -> torch.Tensor:
        """One request's `n` tokens from position `start`: the state read from slot `reads`,
        the state after them written to slot `writes`; the attention output [n, H, D]."""
        assert self.state is not None, "the model runner binds every state before a forward"
        spec, n = self.spec, q.shape[0]
        history = spec.history
        held = min(start, history)
        window, fmt = spec.window(self.state), spec.key_format
        stored = torch.cat((window[reads, history - held :], state_rows.encode(kv, fmt)))
        keys = state_rows.decode(stored, fmt).to(kv.dtype)  # [held + n, D], as stored
        positions = torch.arange(start, start + n, device=q.device)
        compressed, index_keys = self._compress(hidden, start, table, reads, writes)
        out = q.new_empty(q.shape)
        for low in range(0, n, QUERY_BLOCK):
            span = slice(low, min(n, low + QUERY_BLOCK))
            chosen = None
            if self.indexer is not None and index_keys is not None:  # this block's choice
                rotary = self._rotary.table
                score = self.indexer.scores(
                    hidden[span], latent[span], positions[span], index_keys, rotary
                )
                chosen = self.indexer.select(score, positions[span])
            out[span] = self._attend(q[span], keys, held, low, positions[span], compressed, chosen)
        kept = min(history, held + n)
        window[writes, history - kept :] = stored[held + n - kept :]
        return out

    def _compress(
        self,
        hidden: torch.Tensor,
        start: int,
        table: Sequence[int],
        reads: int,
        writes: int,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Close the windows these tokens complete, page their keys and carry the rest; the
        request's compressed keys so far, and (sparse layers) its indexer keys."""
        if self.compressor is None or self.keys is None:
            return None, None
        assert self.state is not None
        compressors = [(self.compressor, self.keys)]
        if self.indexer is not None and self.index_keys is not None:
            compressors.append((self.indexer, self.index_keys))
        found: list[torch.Tensor] = []
        for index, (compressor, paged) in enumerate(compressors):
            carry = self.spec.read_carry(self.state, index, reads, start, hidden.dtype)
            new, after = compressor.compress(hidden, carry, self._rotary.table)
            paged.store(new, table, carry.windows)
            self.spec.write_carry(self.state, index, writes, after)
            found.append(paged.read(table, after.windows, hidden.dtype))
        return found[0], found[1] if len(found) > 1 else None

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        held: int,
        low: int,
        positions: torch.Tensor,
        compressed: torch.Tensor | None,
        chosen: torch.Tensor | None,
    ) -> torch.Tensor:
        """Queries `low ..` of the row ([b, H, D], at `positions`) over the window keys each
        reaches and the compressed keys it may see, with the sink, in one float32 softmax."""
        history, b = self.spec.history, q.shape[0]
        first = max(0, held + low - history)
        span = keys[first : held + low + b].float()  # [m, D]
        index = torch.arange(first, held + low + b, device=q.device)[None]
        own = torch.arange(low, low + b, device=q.device)[:, None] + held
        visible = (index <= own) & (index >= own - history)  # [b, m]
        qf = q.float()
        window = torch.einsum("bhd,md->hbm", qf, span) * self.scale
        scores = [window.masked_fill(~visible, float("-inf"))]
        values = [span]
        if compressed is not None and compressed.shape[0]:
            if chosen is None:  # every closed window
                picked = compressed.float()  # [T, D]
                closed = (positions + 1) // self.rate
                seen = torch.arange(picked.shape[0], device=q.device)[None] < closed[:, None]
                logits = torch.einsum("bhd,td->hbt", qf, picked) * self.scale
            else:  # the indexer's choice, gathered
                picked = compressed[chosen.clamp(min=0)].float()  # [b, k, D]
                seen = chosen >= 0
                logits = torch.einsum("bhd,bkd->hbk", qf, picked) * self.scale
            scores.append(logits.masked_fill(~seen, float("-inf")))
            values.append(picked)
        sink = self.sinks.float().view(-1, 1, 1).expand(-1, b, 1)
        probs = torch.softmax(torch.cat([*scores, sink], dim=-1), dim=-1)
        widths = [score.shape[-1] for score in scores]
        parts = probs[..., : sum(widths)].split(widths, dim=-1)
        out = torch.einsum("hbm,md->bhd", parts[0], values[0])
        if len(parts) > 1:
            pattern = "hbt,td->bhd" if chosen is None else "hbk,bkd->bhd"
            out = out + torch.einsum(pattern, parts[1], values[1])
        return out.to(q.dtype)
