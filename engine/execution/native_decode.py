"""The decode step in one native call on CPUs (`kernels.decoder_step_cpu`), chosen once per
model and device.

Its twin is the model's PyTorch layer path, which runs every step this does not take: prefill
chunks, verify rows and layer slices (a step of decode rows only, one token each, is the one
this takes). It applies to the plain Llama-family decoder (Llama, SmolLM2, Qwen2 with its q/k/v
biases, Qwen3 with its per-head q/k norms, Mistral) on a CPU, float32 activations, a world of
one, with weights it reads (GGML Q4_0 / Q4_1 / Q8_0 blocks, dense float32 / bfloat16 / float16)
and the paged cache the CPU attention kernel reads. Mixture-of-experts, latent and linear
attention, hyper-connection streams, attention sinks and sliding windows keep the twin; `why_not`
says which condition failed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dgpp.engine.backends.base import BatchLayout
from dgpp.engine.backends.cpu_paged import CpuPagedAttention
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.layers.linear import PackableLinear
from dgpp.engine.layers.norm import RMSNorm
from dgpp.engine.models.llama import DecoderAttention, DecoderLayer, DecoderMLP, DecoderModel
from dgpp.kernels import decoder_step_cpu
from dgpp.kernels.kv_quant import kv_format
from dgpp.kernels.paged_attention_cpu import (
    HEAD_DIM_MULTIPLE,
    MAX_BLOCK_SIZE,
    MAX_GROUP,
    cpu_kv_kind,
)

log = logging.getLogger(__name__)


def _linears(layer: DecoderLayer) -> Iterator[PackableLinear]:
    attn, mlp = layer.self_attn, layer.mlp
    yield from (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


def covered_linears(model: nn.Module) -> list[PackableLinear]:
    """The linear layers the native step reads as they are (not to be repacked for oneDNN)."""
    return [linear for layer in model.model.layers for linear in _linears(layer)]


def _layer_why_not(layer: nn.Module, block_size: int) -> str | None:
    if type(layer) is not DecoderLayer or layer.mixer_name != "self_attn":
        return f"layer type {type(layer).__name__}"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not DecoderAttention or type(mlp) is not DecoderMLP:
        return f"attention {type(attn).__name__}, MLP {type(mlp).__name__}"
    norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
    if any(norm is not None and type(norm) is not RMSNorm for norm in norms):
        return "a norm other than RMSNorm"
    paged = attn.attn
    if type(paged.backend) not in (CpuPagedAttention, TorchPagedAttention):
        return f"attention backend {paged.backend.name}"
    kv_dtype = getattr(paged.backend, "kv_dtype", "auto")
    if cpu_kv_kind(kv_format(kv_dtype, attn.head_dim)) is None:
        return f"a {kv_dtype} KV cache (the native step reads float32, int8 of 32s and fp8)"
    if paged.static_kv:
        return "the checkpoint's static FP8 KV scales (the native step stores a scale per row)"
    if paged.sinks is not None or paged.sliding_window is not None:
        return "attention sinks or a sliding window"
    if attn.rotary_dim != attn.head_dim:
        return "partial rotary"
    group = attn.num_heads // attn.num_kv_heads
    if (
        attn.num_heads % attn.num_kv_heads
        or group > MAX_GROUP
        or attn.head_dim % HEAD_DIM_MULTIPLE
        or block_size > MAX_BLOCK_SIZE
    ):
        return "head shapes or block size outside the attention kernel's"
    if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None:
        return "o / MLP biases"
    for linear in _linears(layer):
        if linear.weight is None or linear.packed is not None:
            return "weights already repacked"
        if decoder_step_cpu.weight_kind(linear.weight, linear.weight_format) is None:
            return f"weight format {linear.weight_format or linear.weight.dtype}"
    return None


def why_not(
    model: nn.Module, device: torch.device, dtype: torch.dtype, tp_size: int, block_size: int
) -> str | None:
    """Why the native step does not apply to `model` (None: it does, before its kernel is
    built)."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"{device.type} {dtype}: it takes CPUs and float32 activations"
    if tp_size != 1:
        return "a world of several ranks (its products are not all-reduced)"
    decoder = getattr(model, "model", None)
    if type(decoder) is not DecoderModel or not len(decoder.layers):
        return f"decoder {type(decoder).__name__}"
    if decoder.rotary.head_dim != model.config.head_dim:
        return "partial rotary"
    shapes = set()
    for layer in decoder.layers:
        reason = _layer_why_not(layer, block_size)
        if reason is not None:
            return reason
        attn = layer.self_attn
        width = layer.mlp.down_proj.input_size_local
        shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim, width))
    if len(shapes) > 1:
        return "layers of different shapes"
    return None


@dataclass(frozen=True)
class _Inputs:
    slots: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor


class NativeDecode:
    """The native step over `model`'s layers and the caches bound to them."""

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        decoder: DecoderModel = model.model
        first = decoder.layers[0].self_attn
        self.decoder = decoder
        self.step = decoder_step_cpu.new_step(
            config.hidden_size,
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            decoder.layers[0].mlp.down_proj.input_size_local,
            config.rms_norm_eps,
            first.attn.scale,
        )
        empty = torch.empty(0)
        for layer in decoder.layers:
            attn = layer.self_attn
            qkv, o, gate_up, down = _linears(layer)
            self.step.add_layer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                empty if attn.q_norm is None else attn.q_norm.weight,
                empty if attn.k_norm is None else attn.k_norm.weight,
                *_weight(qkv),
                empty if qkv.bias is None else qkv.bias,
                *_weight(o),
                *_weight(gate_up),
                *_weight(down),
                attn.attn.cache,
                cpu_kv_kind(
                    kv_format(getattr(attn.attn.backend, "kv_dtype", "auto"), attn.head_dim)
                ),
            )

    @staticmethod
    def takes(layout: BatchLayout) -> bool:
        """A step of decode rows only, one token each."""
        rows = layout.rows
        return (
            bool(rows)
            and layout.num_decodes == len(rows)
            and all(row.num_tokens == 1 for row in rows)
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout
    ) -> torch.Tensor:
        """The normed hidden states [B, hidden] of the decode rows (what the model's forward
        returns), their keys and values stored in the cache."""
        inputs = _step_inputs(layout)
        hidden = self.decoder.embed_tokens(input_ids).contiguous()
        rotary = self.decoder.rotary
        cos, sin = rotary.cos[positions], rotary.sin[positions]
        self.step.forward(hidden, cos, sin, inputs.slots, inputs.tables, inputs.seq_lens)
        return self.decoder.norm(hidden)


def _weight(linear: PackableLinear) -> tuple[torch.Tensor, int]:
    assert linear.weight is not None
    kind = decoder_step_cpu.weight_kind(linear.weight, linear.weight_format)
    assert kind is not None
    return linear.weight.detach(), kind


def _step_inputs(layout: BatchLayout) -> _Inputs:
    block_size = layout.block_size
    slots, lens, tables = [], [], []
    width = max(len(row.block_table) for row in layout.rows)
    for row in layout.rows:
        position = row.start
        table = row.block_table
        slots.append(table[position // block_size] * block_size + position % block_size)
        lens.append(row.seq_len)
        tables.append([*table, *[0] * (width - len(table))])

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return _Inputs(tensor(slots), tensor(tables), tensor(lens))


def sixteen_bit_dtype(config: ModelConfig) -> torch.dtype | None:
    """The 16-bit dtype the checkpoint stores its dense weights in: safetensors' `torch_dtype`,
    or a GGUF's F16 / BF16 (its most common dense type); None for float32 checkpoints."""
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    if config.weight_formats:
        counts: dict[str, int] = {}
        for fmt in config.weight_formats.formats.values():
            counts[fmt] = counts.get(fmt, 0) + 1
        dense = sorted((n, fmt) for fmt, n in counts.items() if fmt in ("F16", "BF16"))
        return {"F16": torch.float16, "BF16": torch.bfloat16}[dense[-1][1]] if dense else None
    return names.get(config.checkpoint_dtype or "")


def narrow_weights(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Keep the covered layers' float32 weights in `dtype` where that holds their values exactly
    (a 16-bit checkpoint expanded to float32 at load): the step reads them at half the bytes,
    widening in registers, and the layer path widens them per product. Returns how many were
    narrowed."""
    if dtype is None:
        return 0
    narrowed = 0
    for linear in covered_linears(model):
        weight = linear.weight
        if weight is None or linear.weight_format is not None or weight.dtype != torch.float32:
            continue
        narrow = weight.detach().to(dtype)
        if torch.equal(narrow.float(), weight.detach()):
            linear.weight = nn.Parameter(narrow, requires_grad=False)
            narrowed += 1
    if narrowed:
        log.info("%d linear layers keep their %s weights", narrowed, str(dtype).split(".")[-1])
    return narrowed


def applies(
    model: nn.Module, device: torch.device, dtype: torch.dtype, tp_size: int, block_size: int
) -> bool:
    """Whether the native step serves `model`'s decode steps: it applies and its kernel builds
    (asked before the weights are repacked: the layers it covers keep theirs as loaded); the
    reason it does not is logged once."""
    reason = why_not(model, device, dtype, tp_size, block_size)
    if reason is None and decoder_step_cpu.cpu_extension() is None:
        reason = "its kernel could not be built"
    if reason is not None:
        log.info("decode runs the PyTorch layer path: %s", reason)
        return False
    log.info("decode runs the fused native step (%d layers)", len(model.model.layers))
    return True
