"""Per-rank memory plan: what the weights, the KV pool and one step's activations will take,
checked against what the device can give before anything heavy is allocated.

Weight and KV bytes are exact (they follow the layer shapes of `engine/layers`); the step workspace
is an estimate (see `workspace_bytes`). Memory readings arrive as a `DeviceMemory`, so a plan is a
pure function of its inputs and tests need not depend on the machine they run on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from dgpp.engine.backends.cache_spec import CacheSpec
from dgpp.engine.backends.state_cache import StateLayout
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ConfigError
from dgpp.engine.layers.head_partition import partition_heads
from dgpp.engine.layers.ple import ple_table_bytes
from dgpp.engine.models.registry import (
    attention_workspace,
    layer_cache_specs,
    layer_mtp_cache_specs,
)
from dgpp.engine.planning.device_memory import DeviceMemory, read_device_memory
from dgpp.engine.planning.state_plan import engine_state_layout
from dgpp.engine.planning.weight_count import rank_weight_bytes, uses_mtp
from dgpp.kernels.linear import select_packer

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32_BYTES = 4
WORKSPACE_MARGIN = 1.25  # on top of the counted activations: temporaries the sum misses
SAMPLER_COPIES = 4  # fp32 [rows, vocab] copies alive while sampling: logits, probs, sort, indices
# Scoring a prompt (`prompt_logprobs`) returns the logits of every position of its chunk; they
# are scored `SCORE_ROWS` at a time, with `SCORE_COPIES` fp32 copies (log-softmax, rank mask).
SCORE_ROWS, SCORE_COPIES = 128, 2
# `size_kv_pool` leaves this share of the budget unused, so the same plan still fits when it is
# checked again, slightly later, after small allocations (the tokenizer) moved the free memory.
SIZING_SLACK = 0.02
MIB, GIB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    """What one rank will hold, in bytes, and what it may hold.

    `buffers_bytes` are fixed tensors that are not parameters: the float32 rotary tables, where
    linears are prepacked (oneDNN on CPU) the LM head's packed copy beside its dense weight, and
    on CUDA what the decode graphs keep (`decode_graph_bytes`)."""

    weights_bytes: int
    kv_bytes: int
    kv_tokens: int
    buffers_bytes: int
    workspace_bytes: int
    total_bytes: int
    budget_bytes: int
    available_bytes: int
    device: str
    state_bytes: int = 0  # recurrent layers: running requests' states and prefix snapshots
    # Qwen4-Exp's PLE n-gram tables: read by row from the checkpoint (not counted), or held in
    # host RAM with `ngram_tables_in_memory` (counted in the total)
    table_bytes: int = 0
    tables_in_memory: bool = False
    # The prefix cache's host tier (`prefix_cache_host_gib`): host RAM, so counted in the total
    # only where the device is the CPU.
    host_tier_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    def describe(self) -> str:
        state = f"states {format_bytes(self.state_bytes)} + " if self.state_bytes else ""
        tables, on_disk = "", ""
        if self.table_bytes and self.tables_in_memory:
            tables = f"n-gram tables {format_bytes(self.table_bytes)} in RAM + "
        elif self.table_bytes:
            on_disk = f"; n-gram tables {format_bytes(self.table_bytes)} read from disk by row"
        if self.host_tier_bytes:
            on_disk += f"; prefix cache host tier {format_bytes(self.host_tier_bytes)}"
        return (
            f"weights {format_bytes(self.weights_bytes)} + {tables}KV pool "
            f"{format_bytes(self.kv_bytes)} ({self.kv_tokens} tokens) + {state}buffers "
            f"{format_bytes(self.buffers_bytes)} + workspace {format_bytes(self.workspace_bytes)} "
            f"= {format_bytes(self.total_bytes)} of a {format_bytes(self.budget_bytes)} budget "
            f"({format_bytes(self.available_bytes)} free) on {self.device}{on_disk}"
        )


def format_bytes(num_bytes: int) -> str:
    if abs(num_bytes) >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    return f"{num_bytes / MIB:.1f} MiB"


@dataclass(frozen=True)
class RankShapes:
    """One rank's share of each sharded dimension, by the rules of `engine/layers`: whole
    key/value groups per rank (`partition_heads`, rank 0 holding the most when the split is
    uneven), even splits of the MLP, and rows of the vocabulary padded to a multiple of tp_size."""

    num_heads: int
    num_kv_heads: int  # one replicated head when there are fewer kv heads than ranks
    intermediate_size: int
    vocab_rows: int  # rows of the padded vocabulary this rank holds
    padded_vocab_size: int

    @classmethod
    def of(cls, model: ModelConfig, tp_size: int, tp_rank: int = 0) -> RankShapes:
        try:
            heads = partition_heads(model.num_heads, model.num_kv_heads, tp_size, tp_rank)
        except ValueError as err:
            raise ConfigError(f"cannot shard this model over {tp_size} ranks: {err}") from None
        if model.intermediate_size % tp_size:
            raise ConfigError(
                f"intermediate_size={model.intermediate_size} is not divisible by tp_size={tp_size}"
            )
        padded_vocab = -(-model.vocab_size // tp_size) * tp_size
        return cls(
            num_heads=heads.num_q,
            num_kv_heads=heads.num_kv,
            intermediate_size=model.intermediate_size // tp_size,
            vocab_rows=padded_vocab // tp_size,
            padded_vocab_size=padded_vocab,
        )


def kv_bytes_per_token(config: EngineConfig, specs: Sequence[CacheSpec]) -> int:
    """One token's slot in every layer's cache (the layers' `cache_spec`s, summed)."""
    dtype = getattr(torch, config.resolved_dtype)
    return sum(spec.bytes_per_token(dtype) for spec in specs)


def rank_cache_specs(
    model: ModelConfig, tp_size: int, tp_rank: int, mtp: bool = False, kv_dtype: str = "auto"
) -> list[CacheSpec]:
    """The cache specs of rank `tp_rank`'s layers (with `mtp`, the MTP layer's, as the last's),
    paged keys and values at `kv_dtype` (`ConfigError` where the family cannot take it)."""
    parallel = ParallelContext(tp_rank=tp_rank, tp_size=tp_size)
    specs = layer_cache_specs(model, parallel, kv_dtype)
    return specs + layer_mtp_cache_specs(model, parallel, kv_dtype) if mtp else specs


def workspace_bytes(
    config: EngineConfig, model: ModelConfig, shapes: RankShapes, max_context: int
) -> int:
    """Estimated peak activation memory of one step, times `WORKSPACE_MARGIN`.

    A step holds at most T = prefill_chunk_tokens + max_concurrency tokens (the prefill budget plus
    one token per decode row) and samples at most R = max_concurrency rows. Layers run one after
    another, so the peak is the residual stream plus the largest of:
    - attention: fused qkv, rotated q/k and the output [T, *, D]; a prefill chunk's fp32 scores and
      probabilities against the longest context [chunk, H, S] with its keys and values gathered in
      fp32 and expanded to the query heads [S, H, D]; decode scores [R, H, S];
    - MLP: fused gate/up [T, 2I] plus silu(gate) and the product [T, I];
    - logits: the local fp32 slice [R, V/tp], `SAMPLER_COPIES` fp32 copies of the gathered
      [R, V], and the LM head cast to fp32 when fp32 logits come from a lower-precision model;
      a scored prompt chunk adds its positions' logits [chunk, V/tp] and [chunk, V] and the
      scoring's copies of `SCORE_ROWS` of them.
    The torch twin's decode key/value gather (all decode rows padded to the longest) is not
    counted: it is kernel-specific and goes with the paged kernels; the margin covers modest use.
    """
    b = DTYPE_BYTES[config.resolved_dtype]
    rows = config.max_concurrency
    chunk = config.prefill_chunk_tokens
    tokens = chunk + rows
    heads, kv_heads, head_dim = shapes.num_heads, shapes.num_kv_heads, model.head_dim
    # MLA (DeepSeek-V3) expands its cached latents to per-head keys of qk_nope + qk_rope dims
    # and values of v_head_dim; other attention uses head_dim for both.
    raw = model.raw
    key_dim = int(raw.get("qk_nope_head_dim", 0)) + int(raw.get("qk_rope_head_dim", 0))
    value_dim = int(raw.get("v_head_dim", 0))
    if not (raw.get("kv_lora_rank") and key_dim and value_dim):
        key_dim = value_dim = head_dim
    inter, hidden = shapes.intermediate_size, model.hidden_size
    residual = 3 * tokens * hidden * b  # residual, normed input, sublayer output
    attention = (
        tokens * (2 * heads + 3 * kv_heads) * head_dim * b  # qkv and rotated q/k
        + tokens * heads * head_dim * b  # attention output
        + 2 * chunk * heads * max_context * FP32_BYTES  # prefill scores and probabilities
        + max_context * heads * (key_dim + value_dim) * FP32_BYTES  # gathered keys, values
        + rows * heads * max_context * FP32_BYTES  # decode scores
    )
    own = attention_workspace(model, tokens, chunk, heads, max_context, b)
    attention = attention if own is None else own  # a family's own (DeepSeek-V4's)
    mlp = tokens * 2 * inter * b + 2 * tokens * inter * b
    scored = min(chunk, config.max_scored_prompt_tokens)
    logits = (
        (rows + scored) * (shapes.vocab_rows + shapes.padded_vocab_size) * FP32_BYTES
        + (SAMPLER_COPIES - 1) * rows * shapes.padded_vocab_size * FP32_BYTES
        + SCORE_COPIES * min(scored, SCORE_ROWS) * shapes.padded_vocab_size * FP32_BYTES
    )
    if b != FP32_BYTES and config.prefill_precision == "fp32":
        logits += shapes.vocab_rows * hidden * FP32_BYTES  # LM head weight cast for fp32 logits
    return math.ceil((residual + max(attention, mlp, logits)) * WORKSPACE_MARGIN)


def buffers_bytes(
    config: EngineConfig, model: ModelConfig, shapes: RankShapes, max_context: int
) -> int:
    rotary = 2 * max_context * model.head_dim * FP32_BYTES  # cos and sin tables [P, D]
    dtype = getattr(torch, config.resolved_dtype)
    packs_lm_head = select_packer(torch.device(config.device), dtype) is not None
    head = "model.embed_tokens" if model.tie_word_embeddings else "lm_head"
    packs_lm_head = packs_lm_head and model.weight_formats.packed([head]) is None
    lm_head = shapes.vocab_rows * model.hidden_size
    return rotary + packs_lm_head * lm_head * DTYPE_BYTES[config.resolved_dtype]


def decode_graph_bytes(
    config: EngineConfig,
    model: ModelConfig,
    shapes: RankShapes,
    specs: Sequence[CacheSpec],
    max_context: int,
    state_slot_bytes: int = 0,
) -> int:
    """CUDA-graph decode (`engine/execution/decode_graphs.py`, CUDA only): the scratch KV block past
    the pool (and a hybrid model's scratch state slot, `state_slot_bytes`), the static inputs and
    block tables, and what the graphs' memory pool keeps of the largest bucket's step (counted
    as `workspace_bytes` counts a step, for its rows)."""
    if not config.device.startswith("cuda") or config.cuda_graph_max_batch == 0:
        return 0
    b = DTYPE_BYTES[config.resolved_dtype]
    rows = min(config.cuda_graph_max_batch, config.max_concurrency)
    heads, kv_heads, head_dim = shapes.num_heads, shapes.num_kv_heads, model.head_dim
    max_blocks = -(-max_context // config.block_size)
    static = (5 * rows + rows * max_blocks) * 8
    step = 3 * rows * model.hidden_size * b + max(
        rows * (3 * heads + 3 * kv_heads) * head_dim * b,
        4 * rows * shapes.intermediate_size * b,
        rows * (shapes.vocab_rows + shapes.padded_vocab_size) * b,
    )
    scratch = config.block_size * kv_bytes_per_token(config, specs)
    return scratch + state_slot_bytes + static + math.ceil(step * WORKSPACE_MARGIN)


def plan_memory(
    config: EngineConfig,
    model: ModelConfig,
    tp_size: int,
    memory: DeviceMemory | None = None,
    tp_rank: int = 0,
    weights: int | None = None,
) -> MemoryPlan:
    """The plan of rank `tp_rank` of a `tp_size` world (rank 0 holds the largest share);
    `memory` defaults to a reading of the device; `weights`, when known, is this rank's
    `rank_weight_bytes` (planning many pools for one model counts them once)."""
    shapes = RankShapes.of(model, tp_size, tp_rank)
    mtp = uses_mtp(config.speculative, model)
    specs = rank_cache_specs(model, tp_size, tp_rank, mtp, config.kv_cache_dtype)
    if weights is None:
        dtype_bytes = DTYPE_BYTES[config.resolved_dtype]
        weights = rank_weight_bytes(model, tp_size, tp_rank, dtype_bytes, mtp)
    max_context = config.effective_max_model_len(model)
    states = engine_state_layout(config, model, tp_size, tp_rank)
    return _plan(config, model, shapes, specs, memory, max_context, weights, states)


def _plan(
    config: EngineConfig,
    model: ModelConfig,
    shapes: RankShapes,
    specs: Sequence[CacheSpec],
    memory: DeviceMemory | None,
    max_context: int,
    weights: int,
    states: StateLayout,
) -> MemoryPlan:
    memory = (
        memory
        if memory is not None
        else read_device_memory(config.device, int(config.os_memory_floor_gib * GIB))
    )
    kv_tokens = config.num_kv_blocks * config.block_size
    kv = kv_tokens * kv_bytes_per_token(config, specs)
    buffers = buffers_bytes(config, model, shapes, max_context)
    buffers += decode_graph_bytes(config, model, shapes, specs, max_context, states.slot_bytes)
    workspace = workspace_bytes(config, model, shapes, max_context)
    tables = ple_table_bytes(model, DTYPE_BYTES.get(model.checkpoint_dtype or "", 2))
    held = tables if config.ngram_tables_in_memory else 0
    host_tier = 0
    if config.prefix_cache and config.prefix_cache_host_gib > 0:
        block = kv_bytes_per_token(config, specs) * config.block_size
        host_tier = int(config.prefix_cache_host_gib * GIB)  # a hybrid model's: both kinds
        host_tier = host_tier // block * block if not states.total_bytes else host_tier
    held += host_tier if config.device == "cpu" else 0
    return MemoryPlan(
        weights_bytes=weights,
        kv_bytes=kv,
        kv_tokens=kv_tokens,
        buffers_bytes=buffers,
        workspace_bytes=workspace,
        state_bytes=states.total_bytes,
        total_bytes=weights + kv + buffers + workspace + states.total_bytes + held,
        budget_bytes=memory.budget(config.memory_fraction),
        available_bytes=memory.free_bytes,
        device=memory.description,
        table_bytes=tables,
        tables_in_memory=config.ngram_tables_in_memory,
        host_tier_bytes=host_tier,
    )


def check_fits(plan: MemoryPlan) -> None:
    """Raise `ConfigError` naming every part of the plan and what to change when it does not fit."""
    if plan.fits:
        return
    fixed = plan.total_bytes - plan.kv_bytes
    room = plan.budget_bytes - fixed
    per_token = plan.kv_bytes // plan.kv_tokens
    hint = (
        f"at most about {room // per_token} KV tokens would fit"
        if room >= per_token
        else "not even the weights and workspace fit"
    )
    raise ConfigError(
        f"this rank's memory plan does not fit: {plan.describe()}; {hint}. "
        "Lower kv_capacity (--kv-capacity), max_concurrency (--max-concurrency) or "
        "prefill_chunk_tokens (--prefill-chunk-tokens), raise memory_fraction "
        "(--memory-fraction), or use more ranks (tensor parallelism) to shard the model"
    )


def size_kv_pool(
    config: EngineConfig,
    model: ModelConfig,
    tp_size: int,
    memory: DeviceMemory | None = None,
) -> EngineConfig:
    """With `memory_fraction`, a config whose `kv_capacity` is what the budget leaves after the
    weights, buffers and workspace (whole blocks); otherwise `config` itself.

    The pool holds at least one request of the longest context (`max_model_len`, else the model's
    position limit) or this refuses, and at most `max_concurrency` of them: beyond that, blocks
    only lengthen the prefix cache's memory. Deterministic given its inputs, so rank 0 computes it
    once and hands the result to every rank."""
    if config.memory_fraction is None:
        return config
    memory = (
        memory
        if memory is not None
        else read_device_memory(config.device, int(config.os_memory_floor_gib * GIB))
    )
    max_context = config.max_model_len or model.max_position_embeddings
    block_size = config.block_size
    shapes = RankShapes.of(model, tp_size)  # rank 0: no rank holds more
    mtp = uses_mtp(config.speculative, model)
    specs = rank_cache_specs(model, tp_size, 0, mtp, config.kv_cache_dtype)
    weights = rank_weight_bytes(model, tp_size, 0, DTYPE_BYTES[config.resolved_dtype], mtp)
    # Recurrent state slots with the whole snapshot budget (not yet capped by the pool's size).
    states = engine_state_layout(config, model, tp_size, max_snapshots=1 << 62)
    probe = _plan(
        replace(config, kv_capacity=block_size),
        model,
        shapes,
        specs,
        memory,
        max_context,
        weights,
        states,
    )
    fixed = probe.total_bytes - probe.kv_bytes
    room = int(probe.budget_bytes * (1 - SIZING_SLACK)) - fixed
    block_bytes = probe.kv_bytes  # the probe's pool is exactly one block
    num_blocks = max(0, room) // block_bytes
    min_blocks = -(-max_context // block_size)
    if num_blocks < min_blocks:
        raise ConfigError(
            f"memory_fraction={config.memory_fraction} leaves {format_bytes(max(0, room))} for "
            f"the KV pool on {probe.device} (budget {format_bytes(probe.budget_bytes)}, weights "
            f"{format_bytes(probe.weights_bytes)}, buffers {format_bytes(probe.buffers_bytes)}, "
            f"workspace {format_bytes(probe.workspace_bytes)}), but one request of "
            f"{max_context} tokens needs {format_bytes(min_blocks * block_bytes)}. Raise "
            "memory_fraction (--memory-fraction), lower max_model_len (--max-model-len), "
            "max_concurrency or prefill_chunk_tokens, or use more ranks (tensor parallelism)"
        )
    num_blocks = min(num_blocks, config.max_concurrency * min_blocks)
    return replace(config, kv_capacity=num_blocks * block_size)
