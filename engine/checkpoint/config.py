"""Typed, frozen configuration of the checkpoint (`ModelConfig`); how to run it is `EngineConfig`.

`ModelConfig` is parsed once from a checkpoint's `config.json`; `EngineConfig` carries the engine
knobs. Neither is mutated after construction: values learned at run time (how many KV blocks fit,
the effective context limit) produce new objects through `dataclasses.replace`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dgpp.engine.checkpoint.encoder_files import ENCODER_ARCHITECTURES, pooling_mode, sep_token_id
from dgpp.engine.checkpoint.kv_scales import declares_kv_scales
from dgpp.engine.checkpoint.loader import checkpoint_files
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.quant.methods import GROUP_METHODS
from dgpp.engine.quant.quant_schemes import (
    QuantSchemes,
    check_method,
    quant_config,
    schemes_from_meta,
    tensor_meta,
)
from dgpp.engine.quant.weight_formats import WeightFormats
from dgpp.kernels.group_codes import GroupFormat


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised across `rope_scaling` (transformers 4) and
    `rope_parameters` (transformers 5) spellings."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # M-RoPE (Qwen vision-language): frequencies per time/height/width axis, interleaved
    mrope_section: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0  # GLM: rotary on the first half of each head
    checkpoint_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # packed weights: GGUF's per-module GGML types, or a quantized safetensors checkpoint's
    # schemes (GPTQ, AWQ, compressed-tensors, FP8, ModelOpt); both empty when dense
    weight_formats: WeightFormats = field(default_factory=WeightFormats)
    quant_schemes: QuantSchemes = field(default_factory=QuantSchemes)
    kv_scales: bool = False  # static FP8 KV scales declared (`checkpoint.kv_scales`)
    # encoders (`checkpoint.encoder_files`): sentence-transformers' pooling, the separator's id
    pooling_mode: str = ""
    sep_token_id: int | None = None
    # the whole config.json, for the family-specific keys a model file parses itself
    # (MoE routing, MLA ranks, sliding windows: see `dgpp.engine.models`)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def weight_format(
        self, modules: Sequence[str], cols: int, in_start: int = 0, in_total: int = 0
    ) -> str | GroupFormat | None:
        """How a layer fusing checkpoint `modules` keeps its weight: a GGML type, a
        group-quantized form, or None (dense). The rank reads `cols` input columns, from
        `in_start` of `in_total` when its input is split."""
        if self.weight_formats:
            return self.weight_formats.packed(modules, in_start, cols if in_total else 0)
        return self.quant_schemes.group_format(modules, cols, in_start, in_total)

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims the rotary embedding turns."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_encoder(self) -> bool:
        """Whether the model is an encoder (BERT, XLM-RoBERTa): bidirectional, nothing cached."""
        return self.architecture in ENCODER_ARCHITECTURES

    @property
    def is_latent_attention(self) -> bool:
        """Whether the attention is MLA (the config names a key/value latent rank)."""
        return self.raw.get("kv_lora_rank") is not None

    @property
    def quant_method(self) -> str:
        """How the weights are stored: `none`, `gguf`, or a `QuantSchemes` method."""
        if self.weight_formats:
            return "gguf"
        if self.quant_schemes:
            return self.quant_schemes.method
        quant = self.raw.get("quantization_config")
        if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "mxfp4":
            return "mxfp4"  # gpt-oss: its experts, kept by the model itself
        return "none"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        raw = _release_view(_text_view(raw))
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ModelLoadError("config.json names no architectures; cannot pick a model class")
        architecture = BARE_DECODERS.get(architectures[0], architectures[0])
        check_method(quant_config(raw))
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden_size = int(raw["hidden_size"])
            head_dim = raw.get("head_dim") or hidden_size // num_heads
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                architecture=architecture,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=_intermediate_size(raw),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                # MiMo-V2-Flash's release names it as Megatron does
                rms_norm_eps=float(raw.get("rms_norm_eps") or raw.get("layernorm_epsilon") or 1e-6),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                rope=parse_rope(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always carries q/k/v biases; Llama and Qwen3 declare it.
                qkv_bias=architecture == "Qwen2ForCausalLM"
                or bool(raw.get("attention_bias", False)),
                # `attention_bias` covers the output projection too, but for Qwen2 and GLM
                o_proj_bias=bool(raw.get("attention_bias", False))
                and architecture not in ("Qwen2ForCausalLM", "Glm4MoeForCausalLM"),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=architecture in _QK_NORM or bool(raw.get("use_qk_norm", False)),
                hidden_act=str(raw.get("hidden_act", "silu")),
                partial_rotary_factor=float(
                    rope_parameters(raw).get("partial_rotary_factor")
                    or raw.get("partial_rotary_factor")
                    # MiniMax-M2's releases name the rotary dims instead
                    or (raw.get("rotary_dim") or head_dim) / head_dim
                ),
                checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                weight_formats=WeightFormats.from_config(raw),
                raw=raw,
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks the required key {missing}") from None

    @classmethod
    def from_checkpoint(cls, path: Path, raw: dict[str, Any] | None = None) -> ModelConfig:
        """The facts of the checkpoint at `path`: from its config.json, or from `raw` where the
        caller has them (a worker rank: rank 0's, pushed); the quantization layout of a group
        method is read from the checkpoint's own tensor headers either way."""
        if raw is None:
            raw = read_config_json(path)
        quant = quant_config(raw, path)
        config = replace(cls.from_dict(raw), kv_scales=declares_kv_scales(quant))
        if config.is_encoder:
            config = replace(
                config, pooling_mode=pooling_mode(path), sep_token_id=sep_token_id(path)
            )
        method = check_method(quant)
        if quant is None or method not in GROUP_METHODS:
            return config
        meta = tensor_meta(checkpoint_files(path))
        return replace(config, quant_schemes=schemes_from_meta(method, quant, meta))


def read_config_json(path: Path) -> dict[str, Any]:
    """`path/config.json`, refused with the reason when absent or not JSON."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is not a checkpoint: it has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} does not hold a JSON object")
    return raw


def read_generation_config(checkpoint: Path) -> dict[str, Any]:
    """`checkpoint/generation_config.json` as a dict: empty when it is absent, and when it is
    unreadable (a warning; its settings are recommendations, never a reason not to serve)."""
    path = checkpoint / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        logging.getLogger(__name__).warning("ignoring %s: %s", path, err)
        return {}
    return raw if isinstance(raw, dict) else {}


# Bare decoders, as embedding checkpoints are saved (served with `engine.kind: embed`): their
# family's, without the head.
BARE_DECODERS = {
    "LlamaModel": "LlamaForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}

_QK_NORM = (
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)


# Kimi-Linear's config.json (as released and as transformers saves it) names DeepSeek-V3's keys
# its own way; the families read the DeepSeek names.
_KIMI_KEYS = {
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "max_position_embeddings": "model_max_length",
}


def _release_view(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the common names of keys a family's release spells its own way."""
    if raw.get("model_type") != "kimi_linear":
        return raw
    common = {ours: raw[theirs] for ours, theirs in _KIMI_KEYS.items() if theirs in raw}
    return {**common, **raw}


def _text_view(raw: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config (Qwen3.5) as its language model's: the nested `text_config`'s
    keys over the top level's, but the top level's architectures and tied embeddings."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    merged = {**raw, **text, "architectures": raw.get("architectures")}
    if "tie_word_embeddings" in raw:
        merged["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return merged


def _intermediate_size(raw: dict[str, Any]) -> int:
    """The dense MLP width; a MoE config without one (Qwen3.5-MoE: every layer sparse) takes
    its widest expert's, shared or routed."""
    if "intermediate_size" in raw or "moe_intermediate_size" not in raw:
        return int(raw["intermediate_size"])
    shared = raw.get("shared_expert_intermediate_size") or 0
    return max(int(raw["moe_intermediate_size"]), int(shared))


def rope_parameters(raw: Mapping[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """The rotary parameters of `layer_type`'s layers: transformers 5 nests them per layer type
    where the types differ (MiMo-V2-Flash: `full_attention` and `sliding_attention` bases), and
    else keeps one set (`rope_parameters`, or transformers 4's `rope_scaling`)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    nested = params.get(layer_type)
    return dict(nested) if isinstance(nested, Mapping) else dict(params)


def parse_rope(raw: Mapping[str, Any], layer_type: str = "full_attention") -> RopeConfig:
    """The rotary embedding of `layer_type`'s layers."""
    params = rope_parameters(raw, layer_type)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ModelLoadError(f"unsupported RoPE scaling type {rope_type!r}")
    original = params.get("original_max_position_embeddings")
    if original is None and rope_type in ("llama3", "yarn"):
        original = raw.get("max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        original_max_position_embeddings=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        mrope_section=tuple(params["mrope_section"]) if params.get("mrope_section") else None,
    )
