"""Turns a step plan into tensors, runs the model forward and returns the logits to sample from."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dgpp.engine.config import EngineConfig, ModelConfig
from dgpp.engine.errors import ConfigError
from dgpp.engine.layers.embedding import ParallelLMHead
from dgpp.engine.layers.linear import PackableLinear
from dgpp.engine.loader import load_weights
from dgpp.engine.memory_plan import check_fits, lock_memory, plan_memory
from dgpp.engine.models.registry import build_model
from dgpp.engine.parallel import ParallelContext
from dgpp.engine.resident_cache import cache_root, image_key, load_resident
from dgpp.engine.scheduler import StepPlan
from dgpp.kernels.attention_metadata import PagedAttentionMetadata
from dgpp.kernels.dispatch import attention_kernels
from dgpp.kernels.linear import LinearPacker, select_packer
from dgpp.kernels.paged_attention_torch import decode_gather_inputs, decode_query_index

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: PagedAttentionMetadata
    sample_index: torch.Tensor  # [num_sampled]: rows whose logits are sampled (see StepPlan)
    fp32_logits: bool

    def to(self, device: torch.device) -> StepInputs:
        """These inputs on `device` (themselves when already there)."""
        if self.input_ids.device == device:
            return self
        return StepInputs(
            self.input_ids.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            _metadata_to(self.metadata, device),
            self.sample_index.to(device, non_blocking=True),
            self.fp32_logits,
        )


class ModelRunner:
    """Owns the model weights and this rank's KV pool [layers, 2, blocks, block_size, H_kv, D]."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        checkpoint: Path,
        max_model_len: int,
        parallel: ParallelContext | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {config.device!r} requested but this torch sees no CUDA GPU")
        self.dtype = TORCH_DTYPES[config.resolved_dtype]
        self.block_size = config.block_size
        parallel = parallel or ParallelContext()
        # Refuse a plan that cannot fit before any weight or KV byte is allocated.
        plan = plan_memory(config, model_config, parallel.tp_size, tp_rank=parallel.tp_rank)
        check_fits(plan)
        logging.getLogger(__name__).info("memory plan: %s", plan.describe())
        if config.mlock:
            lock_memory()
        kernels = attention_kernels(config.device)
        with torch.device("cpu"):
            model = build_model(model_config, parallel, max_model_len, kernels)
        model = model.to(self.dtype)
        warm = False
        if config.resident_cache:
            key = image_key(
                checkpoint,
                parallel.tp_rank,
                parallel.tp_size,
                config.resolved_dtype,
                self.device.type,
                model_config.architecture,
            )
            warm = load_resident(model, checkpoint, key, cache_root(config.resident_cache_dir))
        else:
            load_weights(model, checkpoint)
        self.model = model.to(self.device).eval()
        # Rotary tables stay float32 whatever the weights' dtype.
        self.model.model.rotary.float()
        packer = select_packer(self.device, self.dtype)
        packable = [
            module
            for module in self.model.modules()
            if isinstance(module, PackableLinear | ParallelLMHead)
        ]
        self.packing: threading.Thread | None = None
        if packer is not None and warm:
            # Warm weights are memory-mapped from the image: serve on them at once and pack on
            # the side (seconds for billions of parameters); each layer switches when packed.
            self.packing = threading.Thread(
                target=_pack_all, args=(packable, packer), name="dgpp-pack", daemon=True
            )
            self.packing.start()
        elif packer is not None:
            _pack_all(packable, packer, keep_dense=False)
        attention = self.model.model.layers[0].self_attn
        started = time.monotonic()
        self.kv_cache = torch.zeros(
            model_config.num_layers,
            2,
            config.num_kv_blocks,
            config.block_size,
            attention.num_kv_heads,
            model_config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_seconds = time.monotonic() - started  # reserving (zeroing) the whole pool

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Forward the plan; float32 logits [plan.num_sampled, padded_vocab], in plan order."""
        return self.execute(self.prepare(plan))

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """The forward every rank runs with identical inputs (collectives inside must match)."""
        inputs = inputs.to(self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        hidden = hidden[inputs.sample_index]
        dtype = torch.float32 if inputs.fp32_logits else None
        return self.model.compute_logits(hidden, dtype).float()

    def prepare(self, plan: StepPlan) -> StepInputs:
        """The step's tensors, built on rank 0 and sent as they are to the other ranks."""
        input_ids, positions, metadata, sample_index = self._prepare(plan)
        fp32_logits = plan.has_prefill and self.config.prefill_precision == "fp32"
        return StepInputs(input_ids, positions, metadata, sample_index, fp32_logits)

    def _prepare(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata, torch.Tensor]:
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_index: list[int] = []
        for chunk in plan.chunks:
            request = chunk.request
            end = chunk.start + chunk.num_tokens
            input_ids.extend(request.token_ids[chunk.start : end - len(chunk.draft)])
            input_ids.extend(chunk.draft)
            span = range(chunk.start, end)
            positions.extend(span)
            table = request.block_table
            slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in span)
            query_start.append(query_start[-1] + chunk.num_tokens)
            seq_lens.append(end)
            # Sampled: the last position, and for a verify row every position of the draft.
            sample_index.extend(range(query_start[-1] - chunk.num_sampled, query_start[-1]))
        max_blocks = max(len(chunk.request.block_table) for chunk in plan.chunks)
        tables = [
            chunk.request.block_table + [0] * (max_blocks - len(chunk.request.block_table))
            for chunk in plan.chunks
        ]
        # Built on the host: rank 0 sends them as they are, every rank moves them to its device.
        device = torch.device("cpu")

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        decode_slots, decode_mask, query_index = None, None, None
        if plan.num_decodes:
            decodes = plan.chunks[: plan.num_decodes]
            query_lens = [chunk.num_tokens for chunk in decodes]
            decode_slots, decode_mask = decode_gather_inputs(
                [chunk.request.block_table for chunk in decodes],
                seq_lens[: plan.num_decodes],
                block_size,
                device,
                query_lens,
            )
            query_index = decode_query_index(query_lens, device)
        metadata = PagedAttentionMetadata(
            slot_mapping=tensor(slots),
            block_tables=tensor(tables),
            query_start_loc=tensor(query_start),
            seq_lens=tensor(seq_lens),
            query_start_loc_host=tuple(query_start),
            seq_lens_host=tuple(seq_lens),
            num_decodes=plan.num_decodes,
            max_seq_len=max(seq_lens),
            prefill_softmax_fp32=self.config.prefill_precision == "fp32",
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            decode_query_index=query_index[0] if query_index else None,
            decode_output_index=query_index[1] if query_index else None,
        )
        return tensor(input_ids), tensor(positions), metadata, tensor(sample_index)

    def warm_up_inputs(self) -> StepInputs:
        """A one-token prefill at position 0 in block 0, sampled: it runs every layer once."""

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        fp32 = self.config.prefill_precision == "fp32"
        metadata = PagedAttentionMetadata(
            slot_mapping=tensor([0]),
            block_tables=tensor([[0]]),
            query_start_loc=tensor([0, 1]),
            seq_lens=tensor([1]),
            query_start_loc_host=(0, 1),
            seq_lens_host=(1,),
            num_decodes=0,
            max_seq_len=1,
            prefill_softmax_fp32=fp32,
            decode_slots=None,
            decode_mask=None,
        )
        return StepInputs(tensor([0]), tensor([0]), metadata, tensor([0]), fp32)


def _pack_all(
    modules: list[PackableLinear | ParallelLMHead], packer: LinearPacker, keep_dense: bool = True
) -> None:
    started = time.monotonic()
    for module in modules:
        module.pack(packer, keep_dense=keep_dense)
    if keep_dense:
        logging.getLogger(__name__).info(
            "packed %d linear layers in the background in %.2f s",
            len(modules),
            time.monotonic() - started,
        )


def _metadata_to(metadata: PagedAttentionMetadata, device: torch.device) -> PagedAttentionMetadata:
    moved = {
        field.name: value.to(device, non_blocking=True)
        for field in dataclasses.fields(metadata)
        if isinstance(value := getattr(metadata, field.name), torch.Tensor)
    }
    return dataclasses.replace(metadata, **moved)
