"""Runs the model forward for a step message: every rank builds its own inputs from the message
and returns the logits to sample from."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from dgpp.engine.backends.base import AttentionBackend, BatchLayout, BatchRow, StepMetadata
from dgpp.engine.backends.cache_spec import allocate_caches, cache_layers, unique_backends
from dgpp.engine.backends.state_cache import (
    LinearStateBackend,
    allocate_states,
    copy_slots,
    state_layers,
    zero_slots,
)
from dgpp.engine.cache.disk_store import IDLE_WAIT_S, DiskStore, agreed_states
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ConfigError
from dgpp.engine.execution import native_decode
from dgpp.engine.execution.background_packing import BackgroundPacking
from dgpp.engine.execution.decode_graphs import DecodeGraphs, why_not_graphed
from dgpp.engine.execution.drafting import Drafter, Drafting, DraftTarget
from dgpp.engine.execution.model_loading import load_model
from dgpp.engine.execution.step_message import BlockTables, StepMessage, StepRow
from dgpp.engine.layers.embedding import ParallelLMHead
from dgpp.engine.layers.linear import PackableLinear
from dgpp.engine.models.registry import layer_cache_specs, layer_state_specs
from dgpp.engine.planning.device_memory import drop_page_cache
from dgpp.engine.planning.host_store import HostStore, host_slots
from dgpp.engine.planning.memory_lock import lock_memory
from dgpp.engine.planning.memory_plan import check_fits, plan_memory
from dgpp.engine.planning.state_plan import engine_state_layout
from dgpp.engine.planning.tier_layout import open_disk_stores
from dgpp.engine.scheduling.scheduler import StepPlan
from dgpp.engine.selfcheck.startup import StartupCheck
from dgpp.engine.vision.runner_glue import (
    check_prompt_images,
    image_inputs,
    vision_for,
    with_encodes,
)
from dgpp.engine.vision.spans import PromptImage
from dgpp.kernels.linear import select_packer

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The warm-up row's seq id: no request has a negative one.
_WARM_UP_SEQ = -1


class ModelRunner:
    """Owns the model weights, this rank's caches (one pool per cache spec, see
    `dgpp.engine.backends.cache_spec`) and the block tables the step messages keep.

    `resident_dir` is where resident weight images live unless the configuration names a
    directory (`resident_cache_dir`); with neither, weights always come from the checkpoint."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        checkpoint: Path,
        max_model_len: int,
        parallel: ParallelContext | None = None,
        resident_dir: Path | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {config.device!r} requested but this torch sees no CUDA GPU")
        self.dtype = TORCH_DTYPES[config.resolved_dtype]
        self.block_size = config.block_size
        parallel = parallel or ParallelContext()
        if config.drop_page_cache:
            logging.getLogger(__name__).info("%s", drop_page_cache())
        # Refuse a plan that cannot fit before any weight or KV byte is allocated.
        plan = plan_memory(config, model_config, parallel.tp_size, tp_rank=parallel.tp_rank)
        check_fits(plan)
        logging.getLogger(__name__).info("memory plan: %s", plan.describe())
        if config.mlock:
            lock_memory()
        self.selfcheck = StartupCheck(config, model_config, parallel, self.device, self.dtype)
        self.selfcheck.before_build()  # the kernels against their twins, before a backend
        model, attention, warm = load_model(
            config, model_config, parallel, checkpoint, max_model_len,
            (self.device, self.dtype), resident_dir,
        )  # fmt: skip
        self.model = model.to(self.device).eval()
        self.selfcheck.after_load(self.model)  # before the layers pick their kernels
        # Rotary tables stay float32 whatever the weights' dtype.
        decoder = getattr(self.model, "model", None)  # an encoder has no rotary tables
        for rotary in (getattr(decoder, "rotary", None), getattr(decoder, "local_rotary", None)):
            if rotary is not None:
                rotary.float()
        packer = select_packer(self.device, self.dtype)
        native = config.native_decode and native_decode.applies(
            self.model, self.device, self.dtype, parallel.tp_size, self.block_size
        )
        kept = set(map(id, native_decode.covered_linears(self.model))) if native else set()
        if native:  # 16-bit checkpoints: their layers' weights read at 16-bit bandwidth
            native_decode.narrow_weights(self.model, native_decode.sixteen_bit_dtype(model_config))
        packable = [
            module
            for module in self.model.modules()
            if isinstance(module, PackableLinear | ParallelLMHead) and id(module) not in kept
        ]
        for module in packable:
            if isinstance(module, PackableLinear):
                module.select_kernels()
        self.packing: BackgroundPacking | None = None
        if packer is not None and warm:
            # Warm weights are memory-mapped from the image: serve on them at once and pack on
            # the side (seconds for billions of parameters); each layer switches when packed.
            self.packing = BackgroundPacking(packable, packer)
        elif packer is not None:
            for module in packable:
                module.pack(packer, keep_dense=False)
        layers = cache_layers(self.model)
        declared = layer_cache_specs(model_config, parallel, config.kv_cache_dtype)  # as planned
        assert [layer.cache_spec for layer in layers] == declared, "cache specs disagree"
        self.backends: list[AttentionBackend] = list(unique_backends(layers))
        recurrent = state_layers(self.model)
        backends = [*self.backends, *([recurrent[0].state_backend] if recurrent else [])]
        graphed = self.device.type == "cuda" and config.cuda_graph_max_batch > 0
        # MTP reads every step's hidden states; embedders and rerankers never decode
        graphed = graphed and config.speculative != "mtp" and config.kind == "generate"
        if graphed:
            reason = "packing weights in the background" if self.packing else None
            reason = reason or why_not_graphed(self.model, backends)
            if reason is not None:
                logging.getLogger(__name__).info("decode runs eagerly: %s", reason)
                graphed = False
        started = time.monotonic()
        # Decode graphs pad their buckets onto one more block, past every block a request gets.
        self.kv_caches = allocate_caches(
            layers, config.num_kv_blocks + graphed, config.block_size, self.dtype, self.device
        )
        # Recurrent layers (hybrid models): a state slot per running request and per snapshot.
        assert [layer.state_spec for layer in recurrent] == layer_state_specs(
            model_config, parallel, config.kv_cache_dtype
        ), "state specs disagree"
        self.state_layout = engine_state_layout(config, model_config, parallel.tp_size)
        # Decode graphs pad their buckets onto one more state slot, past every request's.
        num_slots = self.state_layout.num_slots + (graphed and bool(recurrent))
        self.state_pools = allocate_states(recurrent, num_slots, self.device)
        if recurrent:
            recurrent[0].state_backend.layout = self.state_layout  # verify rows' draft slots
            self.backends.append(recurrent[0].state_backend)
        self.kv_seconds = time.monotonic() - started  # reserving (zeroing) the whole pool
        self.tables = BlockTables()
        self.vision = vision_for(self.model, config, self.device, self.dtype)
        # The fused decode step over the layers and their bound caches (CPU, Llama family).
        self.native = native_decode.NativeDecode(self.model) if native else None
        # The residual stream a layer slice left, by seq id, for the request's next slice.
        self.streams: dict[int, torch.Tensor] = {}
        self.max_model_len = max_model_len
        self.mtp: Drafting | None = None
        if drafter is not None:  # MTP's layers (`drafting`), before the pools are sized
            place = (self.dtype, self.device, config.num_kv_blocks, self.block_size)
            target = DraftTarget(model_config, self.model, parallel, attention, checkpoint, *place)
            self.mtp = drafter(target)
        self.host: HostStore | None = None  # the prefix cache's host tier on this rank
        self.disk: DiskStore | None = None  # and its disk tier, staged through the host tier
        state_bytes = self.state_layout.slot_bytes if recurrent else 0
        self.host_slots, self.state_host_slots = host_slots(
            config, model_config, parallel.tp_size, state_bytes
        )
        if self.host_slots:
            self._open_tiers(config, model_config, checkpoint, parallel, layers)
        self.parallel = parallel
        self.fetch_states: list[int] = []  # every rank's word on the fetches the step polled
        self.graphs: DecodeGraphs | None = None
        if graphed:
            scratch_slot = self.state_layout.num_slots
            self.attach_decode_graphs(
                config.cuda_graph_max_batch, config.num_kv_blocks, True, scratch_slot
            )

    def _open_tiers(
        self,
        config: EngineConfig,
        model: ModelConfig,
        checkpoint: Path,
        parallel: ParallelContext,
        layers: list,
    ) -> None:
        """The host tier (and a hybrid model's snapshots' beside it), and the disk tier's
        stores, which stage their reads there."""
        pools = self._block_pools(layers)
        self.host = HostStore(pools, self.host_slots)
        state_pools = [(pool, 1) for pool in self.state_pools]  # [layers, slots, numel]
        if self.state_host_slots:
            self.host.states = HostStore(state_pools, self.state_host_slots)
        stores = open_disk_stores(
            config, model, checkpoint, parallel.tp_rank, parallel.tp_size, self.host
        )
        if stores is not None:
            self.disk = self.host.disk = stores[0]
            if self.host.states is not None:
                self.host.states.disk = stores[1]

    def _block_pools(self, layers: list) -> list[tuple[torch.Tensor, int]]:
        """Every cache pool (the MTP layer's too) with the axis of its blocks."""
        specs = list(dict.fromkeys(layer.cache_spec for layer in layers))  # allocation order
        pools = [(pool, spec.block_axis) for pool, spec in zip(self.kv_caches, specs, strict=True)]
        if self.mtp is not None:
            mtp_specs = dict.fromkeys(layer.cache_spec for layer in cache_layers(self.mtp.layer))
            pools += [
                (pool, spec.block_axis)
                for pool, spec in zip(self.mtp.caches, mtp_specs, strict=True)
            ]
        return pools

    def attach_decode_graphs(
        self, max_batch: int, scratch_block: int, capture: bool, scratch_slot: int = -1
    ) -> DecodeGraphs:
        """Serve pure decode steps of up to `max_batch` rows through `DecodeGraphs` (captured
        on CUDA at warm-up; `capture=False` runs the same static buffers eagerly). Padded rows
        use KV block `scratch_block` and, in hybrid models, state slot `scratch_slot`."""
        model = self.model
        states = [b for b in self.backends if isinstance(b, LinearStateBackend)]
        attention = [b for b in self.backends if not isinstance(b, LinearStateBackend)]

        def forward(
            ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata
        ) -> torch.Tensor:
            return model.compute_logits(model(ids, positions, metadata))

        self.graphs = DecodeGraphs(
            forward,
            attention[0].name,
            self.device,
            max_batch,
            -(-self.max_model_len // self.block_size),
            self.block_size,
            scratch_block,
            capture,
            states[0].name if states else None,
            scratch_slot,
        )
        return self.graphs

    def message(self, plan: StepPlan) -> StepMessage:
        """Rank 0: the step message of `plan`, against the block tables every rank holds (and
        the images its rows hold that the encoder cache lacks, with their pixels)."""
        message = self.tables.message(plan)
        return with_encodes(self.vision, message, plan) if self.vision else message

    def forget_world(self) -> None:
        """A new world: the other ranks hold no block table, stream or encoded image."""
        self.tables.clear()
        self.streams.clear()
        if self.vision is not None:
            self.vision.cache.clear()

    def check_images(self, prompt_ids: list[int], images: tuple[PromptImage, ...]) -> None:
        """Refuse a prompt's images that this model cannot take (InvalidRequestError)."""
        check_prompt_images(self.model, self.vision, prompt_ids, images)

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Forward the plan on this rank alone (a world of one); logits as `execute`."""
        return self.execute(self.message(plan))

    @torch.inference_mode()
    def execute(self, message: StepMessage) -> torch.Tensor:
        """The forward every rank runs for the same message (collectives inside must match):
        float32 logits [message.num_sampled, padded_vocab], in row order."""
        self.tables.apply(message)
        if self.vision is not None:
            spans = [span for row in message.rows for span in row.images]
            self.vision.encode(message.encode, message.pixels, spans)
        assert self.vision is not None or not message.encode, "images for a text-only model"
        # A one-token prompt is a decode row from position 0: its slot may hold an earlier
        # request's state, and a decode row reads its state (a prefill chunk from 0 does not).
        fresh = [row.state_slot for row in message.rows[: message.num_decodes] if row.start == 0]
        zero_slots(self.state_pools, [slot for slot in fresh if slot >= 0])
        for seq_id in message.finished:
            self.streams.pop(seq_id, None)
        if message.copies:
            assert self.host is not None, "host-tier copies without a host tier"
            self.host.run(message.copies)
        whole = tuple(row for row in message.rows if not row.is_slice)
        plain = message if len(whole) == len(message.rows) else replace(message, rows=whole)
        logits = []
        if self.graphs is not None and self.graphs.fits(plain):  # decode rows, beside a slice
            logits.append(self.graphs.run(plain, self.tables))
        elif whole:
            hidden = self._forward(plain, None)
            if self.mtp is not None:
                read = getattr(self.model, "mtp_input", None)  # DeepSeek-V4: its streams
                self.mtp.keep(plain, hidden if read is None else read(hidden))
            copy_slots(self.state_pools, message.saves)  # states at snapshot points, kept
            logits.append(self._logits(message, whole, hidden))
        for row in message.rows:  # a layer slice (at most one, after the other rows)
            if row.is_slice:
                hidden = self._forward(StepMessage((row,), num_decodes=0), row)
                logits.append(self._logits(message, (row,), hidden))
        if message.poll:  # after the forward: the reads went on beside it
            assert self.disk is not None, "a poll without a disk tier"
            wait_s = 0.0 if message.rows else IDLE_WAIT_S
            states = agreed_states(self.disk, message.poll, wait_s, self.parallel, self.device)
            self.fetch_states = states
        if not logits:  # the disk tier's ops alone
            return torch.empty(0, device=self.device)
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def _forward(self, message: StepMessage, sliced: StepRow | None) -> torch.Tensor:
        """The model over `message`'s rows, or over the layer slice of its one row `sliced`
        (from the stream its previous slice left; the stream is kept for the next one)."""
        fp32 = self.config.prefill_precision == "fp32"
        layout = BatchLayout(
            tuple(
                BatchRow(row.start, row.num_tokens, self.tables[row.seq_id], row.state_slot)
                for row in message.rows
            ),
            message.num_decodes,
            self.block_size,
            prefill_softmax_fp32=fp32,
        )
        input_ids, positions = message.token_inputs(self.device)
        images = image_inputs(self.vision, message)
        if images is not None:
            positions, vision = images
        if images is None and self.native is not None and self.native.takes(layout):
            return self.native.forward(input_ids, positions, layout)
        extra = {"vision": vision} if images is not None else {}
        metadata = {backend.name: backend.prepare(layout) for backend in self.backends}
        if sliced is None:
            # Prefix hits' snapshots, and verify rows' states at their last accepted token.
            copy_slots(self.state_pools, message.restores)
            return self.model(input_ids, positions, metadata, **extra)
        first, stop = sliced.layers
        stream = self.streams.pop(sliced.seq_id, None) if first else None
        hidden = self.model.model.forward_layers(
            input_ids, stream, positions, metadata, (first, stop), **extra
        )
        if stop < len(self.model.model.layers):
            self.streams[sliced.seq_id] = hidden
        return hidden

    def _logits(
        self, message: StepMessage, rows: tuple[StepRow, ...], hidden: torch.Tensor
    ) -> torch.Tensor:
        """Float32 logits of the sampled positions of `rows`, whose forward gave `hidden`."""
        sample_index = []
        at = 0
        for row in rows:
            at += row.num_tokens
            sample_index.extend(range(at - row.num_sampled, at))
        index = torch.tensor(sample_index, dtype=torch.int64, device=hidden.device)
        fp32 = self.config.prefill_precision == "fp32"
        dtype = torch.float32 if message.has_prefill and fp32 else None
        return self.model.compute_logits(hidden[index], dtype).float()

    @torch.inference_mode()
    def draft(self, message: StepMessage) -> list[tuple[int, ...]]:
        """Run the MTP layer over a draft message (`dgpp.engine.speculative.mtp_drafter`) on every
        rank; each row's greedy draft tokens (`num_sampled` of them)."""
        assert self.mtp is not None, "drafts need speculative=mtp"
        self.tables.apply(message)  # slots for the chained positions
        return self.mtp.draft(message, self.tables, self.block_size, self.config)

    def warm_up(self) -> None:
        """A one-token prefill at position 0 in block 0, sampled: it runs every layer once.
        Writes only block 0's first slot and state slot 0, which no request holds yet."""
        slot = 0 if self.state_pools else -1
        row = StepRow(_WARM_UP_SEQ, 0, (0,), 1, 0, (0,), slot)
        self.execute(StepMessage((row,), num_decodes=0))
        self.tables.apply(StepMessage((), 0, finished=(_WARM_UP_SEQ,)))
        self.selfcheck.agree()  # every rank's kernels, before the graphs capture them
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture_all()
                self.graphs = self.selfcheck.check_graphs(self.graphs)
