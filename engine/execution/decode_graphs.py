"""CUDA-graph decode: the decode step captured once per batch-size bucket, then replayed.

A decode step of a few requests launches hundreds of small kernels; on a GPU their launch cost,
not the weight reads, bounds it. The step is captured in a CUDA graph per bucket (1, 2, 4, 8,
16, 24, 32, 48, 64, ... up to `cuda_graph_max_batch`) over static buffers: token ids,
rotary positions, indices in the sequence (apart after a prompt's images: M-RoPE's positions run
behind), sequence lengths, cache slots and block tables. A step of B requests fills the first
B rows, points the rest of its bucket at a scratch KV block no request holds (one token at
position 0, so their attention is well defined and their outputs are dropped) and replays the
bucket's graph; the logits come back for its B rows.

Only pure decode steps replay (one new token per row, no prefill, no recurrent-state copies);
anything else, and any model whose forward reads a host value (a backend without `graph_safe`,
a module marked `host_sync`: quantized per-expert MoE layers count tokens per expert on the
host), runs eagerly. Hybrid models' recurrent layers are captured too: their rows' state slots
are one more static input, and padded rows update a scratch state slot. Every rank captures the
same buckets in the same order during warm-up, so the collectives inside the graphs (tensor
parallelism over NCCL) line up across ranks.

With `capture=False` (CPU, tests) `run` fills the same buffers and calls the forward directly:
the padding and buffer logic is then exercised anywhere; the capture itself needs CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from dgpp.engine.backends.base import AttentionBackend, StepMetadata
from dgpp.engine.backends.state_cache import LinearStateBackend, StateRows
from dgpp.engine.execution.step_message import BlockTables, StepMessage
from dgpp.kernels.attention_metadata import PagedAttentionMetadata

# token ids [T], positions [T], paged metadata -> logits [T, padded_vocab]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, StepMetadata], torch.Tensor]

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Rows of the static [6, max_batch] step inputs: token ids, rotary positions, indices in the
# sequence, sequence lengths, cache slots and recurrent-state slots (hybrid models). A row's
# rotary position is its index but after a prompt's images (M-RoPE: they run behind it); the
# attention kernels read the index (the query's last visible key), never the rotary position.
_IDS, _POSITIONS, _INDEX, _LENS, _SLOTS, _STATES = range(6)
_NUM_INPUTS = 6

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes captured, ending at `max_batch` itself."""
    assert max_batch >= 1
    return (*(size for size in _BUCKETS if size < max_batch), max_batch)


def why_not_graphed(model: torch.nn.Module, backends: Iterable[AttentionBackend]) -> str | None:
    """Why this model's decode step cannot be captured, or None when it can: one paged (or
    latent) attention backend, and the recurrent layers' state backend if the model has them,
    every one `graph_safe`, and no module marked `host_sync`."""
    backends = list(backends)
    attention = [b for b in backends if not isinstance(b, LinearStateBackend)]
    if len(attention) != 1 or len(backends) - len(attention) > 1:
        return f"it attends through {len(backends)} backends; graphs serve one paged backend"
    for backend in backends:
        if not getattr(backend, "graph_safe", False):
            return f"the {backend.name} backend reads host values in its forward"
    for module in model.modules():
        if getattr(module, "host_sync", False):
            return f"{type(module).__name__} reads device values on the host"
    return None


class DecodeGraphs:
    """The static step inputs, one graph (and its output logits) per bucket, and `run`.

    `backend_name` is the paged-attention backend whose metadata the forward reads; it must be
    `graph_safe` (its kernels read the metadata's tensors only). `scratch_block` is a KV block
    no request is ever given: padded rows write and read it. A hybrid model's recurrent layers
    read `state_backend` (its name) with the rows' state slots; padded rows' state goes to
    `scratch_slot`, a state slot no request holds."""

    def __init__(
        self,
        forward: DecodeForward,
        backend_name: str,
        device: torch.device,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        capture: bool,
        state_backend: str | None = None,
        scratch_slot: int = -1,
    ) -> None:
        self.forward = forward
        self.backend_name = backend_name
        self.device = device
        self.buckets = graph_buckets(max_batch)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture = capture
        self.state_backend = state_backend
        assert state_backend is None or scratch_slot >= 0, "padded rows need a scratch state slot"
        self.scratch_slot = scratch_slot
        index = dict(dtype=torch.int64, device=device)
        self.inputs = torch.zeros(_NUM_INPUTS, max_batch, **index)
        self.tables = torch.full((max_batch, max_blocks), scratch_block, **index)
        self.arange = torch.arange(max_batch + 1, **index)  # query starts; token rows
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: object | None = None  # the graphs' shared memory pool
        self.replays = 0  # steps served by a graph (or by the static buffers when not capturing)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def fits(self, message: StepMessage) -> bool:
        """A pure decode step of at most `max_batch` rows, one new token each."""
        rows = message.rows
        return (
            0 < len(rows) <= self.max_batch
            and not message.has_prefill
            and not message.restores
            and not message.saves
            and all(row.num_tokens == 1 for row in rows)
        )

    def bucket(self, batch: int) -> int:
        return next(size for size in self.buckets if size >= batch)

    def _metadata(self, bucket: int) -> StepMetadata:
        """The bucket's metadata: views of the static buffers, valid for every replay."""
        inputs = self.inputs
        metadata = PagedAttentionMetadata(
            slot_mapping=inputs[_SLOTS, :bucket],
            block_tables=self.tables[:bucket],
            query_start_loc=self.arange[: bucket + 1],
            seq_lens=inputs[_LENS, :bucket],
            # Host mirrors: a graph-safe backend reads none; they describe the capture.
            query_start_loc_host=tuple(range(bucket + 1)),
            seq_lens_host=(1,) * bucket,
            num_decodes=bucket,
            max_seq_len=self.tables.shape[1] * self.block_size,
            prefill_softmax_fp32=False,
            token_rows=self.arange[:bucket],
            token_positions=inputs[_INDEX, :bucket],  # keys seen: the index, not the rotary
        )
        step: dict[str, object] = {self.backend_name: metadata}
        if self.state_backend is not None:
            step[self.state_backend] = StateRows(inputs[_STATES, :bucket], ())
        return step

    def _step(self, bucket: int) -> torch.Tensor:
        inputs = self.inputs
        return self.forward(
            inputs[_IDS, :bucket], inputs[_POSITIONS, :bucket], self._metadata(bucket)
        )

    def _pad(self, bucket: int) -> None:
        """Every row of the bucket on the scratch block: one token at position 0."""
        scratch = self.scratch_block * self.block_size
        pad = [[0], [0], [0], [1], [scratch], [self.scratch_slot]]
        self.inputs[:, :bucket] = torch.tensor(pad, device=self.device)
        self.tables[:bucket, 0] = self.scratch_block

    def capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool). A
        no-op without `capture`. Every rank calls this at the same point (warm-up)."""
        if not self.capture:
            return
        for bucket in reversed(self.buckets):
            self._capture(bucket)
        log.info("captured decode graphs for batch sizes %s", ", ".join(map(str, self.buckets)))

    def _capture(self, bucket: int) -> None:
        self._pad(bucket)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(bucket)  # warm-up on a side stream: lazy kernel set-up stays out
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(bucket)
        self.graphs[bucket] = (graph, logits)

    def replayed_and_eager(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The smallest captured bucket's logits from a replay and from an eager run of the same
        padded inputs (the start-up self-check compares them); None when nothing is captured.
        Every rank calls this at the same point (warm-up): both runs hold the step's
        collectives."""
        bucket = self.buckets[0]
        if bucket not in self.graphs:
            return None
        self._pad(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        replayed = logits.float().clone()
        eager = self._step(bucket).float()
        return replayed, eager

    def run(self, message: StepMessage, tables: BlockTables) -> torch.Tensor:
        """Float32 logits [B, padded_vocab] of a step that `fits` (tables already applied)."""
        rows = message.rows
        batch = len(rows)
        bucket = self.bucket(batch)
        block_size = self.block_size
        scratch_slot = self.scratch_block * block_size
        held = [tables[row.seq_id] for row in rows]
        width = max(len(table) for table in held)
        step = [[0] * bucket, [0] * bucket, [0] * bucket, [1] * bucket, [scratch_slot] * bucket]
        step.append([self.scratch_slot] * bucket)
        grid = [[self.scratch_block] * width for _ in range(bucket)]
        for index, (row, table) in enumerate(zip(rows, held, strict=True)):
            pos = row.start
            step[_IDS][index] = row.token_ids[0]
            step[_POSITIONS][index] = pos + row.shift  # after a prompt's images: shifted
            step[_INDEX][index] = pos
            step[_LENS][index] = pos + 1
            step[_SLOTS][index] = table[pos // block_size] * block_size + pos % block_size
            step[_STATES][index] = row.state_slot
            grid[index][: len(table)] = table
        self.inputs[:, :bucket].copy_(torch.tensor(step), non_blocking=True)
        self.tables[:bucket, :width].copy_(torch.tensor(grid), non_blocking=True)
        self.replays += 1
        if not self.capture:
            return self._step(bucket)[:batch].float()
        if bucket not in self.graphs:  # not captured at warm-up (LLM without a server)
            self._capture(bucket)
            self.inputs[:, :bucket].copy_(torch.tensor(step))
            self.tables[:bucket, :width].copy_(torch.tensor(grid))
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:batch].float()
