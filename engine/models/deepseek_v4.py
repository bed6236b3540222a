"""DeepSeek-V4 (`DeepseekV4ForCausalLM`): sliding, compressed sparse and heavily compressed
attention layers (`layers.v4_attention`), manifold-constrained hyper-connections around every
block (`layers.mhc`: `hc_mult` residual streams), and in every layer a mixture of experts with
clamped SwiGLU, routed by a fixed table of the token id in the first `num_hash_layers` layers
(`hash_moe`) and by sqrt(softplus) scores elsewhere.

Caches: no layer pages a key per token. Each layer's last `sliding_window - 1` keys and its
compressors' carries are a per-request state slot; the compressed keys (one per 4 tokens, and
the indexer's; one per 128) are paged by block, so the block size must be a multiple of the
rates (128 for V4-Flash: its templates say so).

Checkpoints: the release's names (`layers.{i}.attn.wq_a`, `ffn.experts.{e}.w1`, `hc_attn_fn`,
...; transformers saves them too) mapped to transformers' module names; the MTP layers
(`mtp.*`) build `speculative: mtp`'s draft layer (`deepseek_v4_mtp.py`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend, StepMetadata
from dgpp.engine.backends.cache_spec import CacheSpec
from dgpp.engine.backends.state_cache import LinearStateBackend
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.activation import ClampedSiluAndMul
from dgpp.engine.layers.compressed_keys import CompressedKeySpec, LayoutBackend
from dgpp.engine.layers.mhc import HyperHead, ManifoldHyperConnection
from dgpp.engine.layers.moe import SparseMoeBlock, expert_target
from dgpp.engine.layers.norm import RMSNorm
from dgpp.engine.layers.rotary import RopeAngles, RotaryEmbedding
from dgpp.engine.layers.v4_attention import (
    QUERY_BLOCK,
    Rotary,
    V4Attention,
    V4Projections,
    v4_state_spec,
)
from dgpp.engine.layers.v4_config import CSA, V4Dims, v4_ropes
from dgpp.engine.layers.v4_experts import Fp4Experts, fp4_expert_target
from dgpp.engine.layers.v4_indexer import SCORE_ELEMENTS
from dgpp.engine.layers.v4_state import V4StateSpec
from dgpp.engine.models.deepseek_v4_mtp import V4MtpLayer, v4_mtp_cache_specs
from dgpp.engine.models.llama import DecoderMLP, DecoderModel, LlamaForCausalLM
from dgpp.engine.models.moe_config import deepseek_v4_moe_spec
from dgpp.engine.vision.step_vision import VisionInputs

# The release's names -> transformers' (its conversion mapping), applied in this order.
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".output.o_a_proj."),
    (r"\.wo_b\.", ".output.o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(experts\.\d+|shared_experts)\.w1\.", r".\1.gate_proj."),
    (r"\.(experts\.\d+|shared_experts)\.w2\.", r".\1.down_proj."),
    (r"\.(experts\.\d+|shared_experts)\.w3\.", r".\1.up_proj."),
    (r"\.self_attn\.o_(a|b)_proj\.", r".self_attn.output.o_\1_proj."),
]
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def v4_checkpoint_name(name: str) -> str | None:
    """A release (or transformers) tensor name as this model's; None for the MTP layers."""
    bare = name.removeprefix("model.")
    if bare.startswith("mtp."):
        return None
    if bare in _TOP:
        return _TOP[bare]
    if not bare.startswith("layers."):
        return name
    for pattern, replacement in _RENAMES:
        bare = re.sub(pattern, replacement, bare)
    return f"model.{bare}"


def expert_dtype(raw: Mapping[str, Any]) -> str:
    """How the routed experts are stored: `fp4` (the release's), `fp8`, or the model dtype;
    top-level in V4's config.json, inside `quantization_config` in later ones."""
    quant = raw.get("quantization_config") or {}
    return str(raw.get("expert_dtype") or quant.get("expert_dtype") or "").lower()


def with_model_names(config: ModelConfig) -> ModelConfig:
    """The config with its quantized modules (found under the release's names in the
    safetensors headers) named as this model's layers are."""
    schemes = config.quant_schemes
    if not schemes.items:
        return config
    renamed = []
    for module, scheme in schemes.items:
        name = v4_checkpoint_name(f"{module}.weight")  # the MTP layer's (None) keep theirs
        renamed.append((module if name is None else name.removesuffix(".weight"), scheme))
    return dataclasses.replace(
        config, quant_schemes=dataclasses.replace(schemes, items=tuple(renamed))
    )


class V4DecoderLayer(nn.Module):
    """Attention and experts, each read from and written into the streams by its mHC."""

    def __init__(self, config: ModelConfig, self_attn: V4Projections, mlp: nn.Module) -> None:
        super().__init__()
        raw, hidden, eps = config.raw, config.hidden_size, config.rms_norm_eps
        streams = int(raw.get("hc_mult") or 4)
        iters, hc_eps = int(raw.get("hc_sinkhorn_iters") or 20), float(raw.get("hc_eps") or 1e-6)
        self.sliding = self_attn.rate == 0
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.attn_hc = ManifoldHyperConnection(streams, hidden, iters, hc_eps, eps)
        self.ffn_hc = ManifoldHyperConnection(streams, hidden, iters, hc_eps, eps)

    def forward(
        self,
        angles: RopeAngles,
        streams: torch.Tensor,
        metadata: StepMetadata,
        input_ids: torch.Tensor,
    ) -> torch.Tensor:
        collapsed, post, comb = self.attn_hc.read(streams)
        out = self.self_attn(angles, self.input_layernorm(collapsed), metadata)
        streams = self.attn_hc.write(streams, out, post, comb)
        collapsed, post, comb = self.ffn_hc.read(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return self.ffn_hc.write(streams, out, post, comb)


class V4DecoderModel(DecoderModel):
    """The embedding copied into `hc_mult` streams, the layers, the head's last read, the
    final norm; the main rotary for sliding layers, the compress rotary for the others."""

    plain_residual = False
    compress_rotary: RotaryEmbedding
    final_streams: torch.Tensor  # the last forward's, for the MTP layer

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        rotary_dim: int,
        layers: list[nn.Module],
    ) -> None:
        super().__init__(config, parallel, max_position, rotary_dim, layers)
        raw = config.raw
        self.streams = int(raw.get("hc_mult") or 4)
        hc_eps = float(raw.get("hc_eps") or 1e-6)
        self.hc_head = HyperHead(self.streams, config.hidden_size, hc_eps, config.rms_norm_eps)
        main, _ = v4_ropes(raw)
        self.rotary = RotaryEmbedding(rotary_dim, max_position, main)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
        vision: VisionInputs | None = None,
    ) -> torch.Tensor:
        del vision  # a text model
        hidden = self.embed_tokens(input_ids)
        angles = self.layer_angles(positions, hidden.dtype)
        streams = hidden.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for index, layer in enumerate(self.layers):
            streams = layer(angles[index], streams, metadata, input_ids)
        self.final_streams = streams  # the MTP layer's input (`mtp_input`)
        return self.norm(self.hc_head(streams))

    def layer_angles(self, positions: torch.Tensor, dtype: torch.dtype) -> Sequence[RopeAngles]:
        main = self.rotary.lookup(positions, dtype)
        compress = self.compress_rotary.lookup(positions, dtype)
        return [main if layer.sliding else compress for layer in self.layers]


class DeepseekV4ForCausalLM(LlamaForCausalLM):
    decoder_model = V4DecoderModel
    decoder_layer = V4DecoderLayer
    mtp_layer = V4MtpLayer
    mtp_cache_specs = staticmethod(v4_mtp_cache_specs)
    checkpoint_name = staticmethod(v4_checkpoint_name)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        """The compressors' `gate_proj` is not a gate/up pair (loaded as itself); experts
        stacked, dense or packed."""
        if ".compressor." in name and ".gate_proj." in name:
            return name, None
        return fp4_expert_target(name) if self.fp4_experts else expert_target(name)

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        config = with_model_names(config)
        self.dims = V4Dims.of(config)
        self.fp4_experts = expert_dtype(config.raw) == "fp4"
        device = getattr(attention, "device", torch.device("cpu"))
        self._state_backend = LinearStateBackend(device, getattr(attention, "kv_dtype", "auto"))
        self._layout_backend = LayoutBackend(device, getattr(attention, "kv_dtype", "auto"))
        _, compress = v4_ropes(config.raw)
        self._rotary = Rotary(RotaryEmbedding(self.dims.rope_dim, max_position, compress))
        super().__init__(config, parallel, max_position, attention)
        model = self.model
        assert isinstance(model, V4DecoderModel)
        model.compress_rotary = self._rotary.table  # moves with the model (device, dtype)

    @staticmethod
    def rotary_dim(config: ModelConfig) -> int:
        return V4Dims.of(config).rope_dim

    def build_layer(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        index: int,
        prefix: str,
    ) -> nn.Module:
        del attention, prefix  # no paged attention: the layers' own caches
        backends = (self._state_backend, self._layout_backend)
        self_attn = V4Attention(self.dims, index, parallel, backends, self._rotary, config)
        return V4DecoderLayer(config, self_attn, self.build_moe(config, parallel, index))

    def build_moe(self, config: ModelConfig, parallel: ParallelContext, index: int) -> nn.Module:
        """Layer `index`'s experts (the MTP layer's too): clamped SwiGLU, FP4 ones packed."""
        spec = deepseek_v4_moe_spec(config.raw, index)
        shared = None
        if spec.shared_intermediate_size:
            shared = DecoderMLP(
                config,
                parallel,
                f"model.layers.{index}.mlp.shared_experts",
                spec.shared_intermediate_size,
            )
            shared.act = ClampedSiluAndMul(spec.swiglu_limit)
        experts = Fp4Experts(spec, config.hidden_size, parallel) if self.fp4_experts else None
        return SparseMoeBlock(spec, config.hidden_size, parallel, shared, experts=experts)

    def mtp_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the MTP layer reads of a step: the streams after the last layer [T, hc, H]
        (`hidden` is the final-normed read of them)."""
        del hidden
        streams: torch.Tensor = self.model.final_streams
        return streams

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """Per compressing layer its compressed keys, and (sparse) its indexer's."""
        del parallel  # replicated on every rank
        dims, specs = V4Dims.of(config), []
        for index, kind in enumerate(dims.layer_types):
            rate = dims.rate(index)
            if rate:
                specs.append(CompressedKeySpec(dims.head_dim, rate, dims.rope_dim))
            if kind == CSA:
                specs.append(CompressedKeySpec(dims.index_dim, rate, index=True))
        return specs

    @classmethod
    def attention_workspace(
        cls,
        config: ModelConfig,
        tokens: int,
        chunk: int,
        heads: int,
        max_context: int,
        dtype_bytes: int,
    ) -> int:
        """One layer's attention activations (`layers.v4_attention`): the step's queries, keys
        and latents; then, per block of `QUERY_BLOCK` queries of a chunk, the window's scores,
        the request's compressed and indexer keys read from their pages (and as float32),
        the indexer's scores in pieces of `SCORE_ELEMENTS`, the gathered sparse keys and the
        scores over them: no term grows with the context but the compressed keys, 1 in 4."""
        dims, f32 = V4Dims.of(config), 4
        block = min(QUERY_BLOCK, chunk)
        sparse = max_context // (dims.rates.get(CSA) or max_context)
        heavy = max(
            (max_context // rate for kind, rate in dims.rates.items() if kind != CSA), default=0
        )
        step = tokens * (2 * heads * dims.head_dim + 2 * dims.head_dim + dims.q_rank) * dtype_bytes
        keys = sparse * (dims.head_dim + dims.index_dim) * (dtype_bytes + f32)
        keys += heavy * dims.head_dim * (dtype_bytes + f32)
        window = 2 * heads * block * (block + dims.window) * f32
        indexer = block * sparse * f32 + 2 * SCORE_ELEMENTS * f32
        topk = min(dims.index_topk, sparse)
        gathered = block * topk * dims.head_dim * f32 + 2 * heads * block * (topk + heavy) * f32
        return step + keys + window + indexer + gathered

    @classmethod
    def state_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[Any]:
        """Every layer's window and carries (replicated on every rank)."""
        del parallel
        dims = V4Dims.of(config)
        specs: list[V4StateSpec] = [v4_state_spec(dims, i) for i in range(config.num_layers)]
        return specs
