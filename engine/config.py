"""Typed, frozen configuration: the checkpoint (`ModelConfig`) and how to run it (`EngineConfig`).

`ModelConfig` is parsed once from a checkpoint's `config.json`; `EngineConfig` carries the engine
knobs. Neither is mutated after construction: values learned at run time (how many KV blocks fit,
the effective context limit) produce new objects through `dataclasses.replace`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from dgpp.engine.errors import ConfigError, ModelLoadError
from dgpp.engine.loader import checkpoint_files
from dgpp.engine.quant.quant_schemes import (
    GROUP_METHODS,
    QuantSchemes,
    check_method,
    quant_config,
    schemes_from_meta,
    tensor_meta,
)
from dgpp.engine.quant.weight_formats import WeightFormats
from dgpp.kernels.group_codes import GroupFormat

PrefillPrecision = Literal["fp32", "model"]
Speculative = Literal["off", "ngram"]
DTYPES = ("float32", "bfloat16", "float16")


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
        raw = _text_view(raw)
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ModelLoadError("config.json names no architectures; cannot pick a model class")
        architecture = architectures[0]
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
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                rope=_parse_rope(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always carries q/k/v biases; Llama and Qwen3 declare it.
                qkv_bias=architecture == "Qwen2ForCausalLM"
                or bool(raw.get("attention_bias", False)),
                # `attention_bias` covers the output projection too, but for Qwen2 and GLM
                o_proj_bias=bool(raw.get("attention_bias", False))
                and architecture not in ("Qwen2ForCausalLM", "Glm4MoeForCausalLM"),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
                or bool(raw.get("use_qk_norm", False)),
                hidden_act=str(raw.get("hidden_act", "silu")),
                partial_rotary_factor=float(
                    (raw.get("rope_parameters") or {}).get("partial_rotary_factor")
                    or raw.get("partial_rotary_factor")
                    or 1.0
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
    def from_checkpoint(cls, path: Path) -> ModelConfig:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{path} is not a checkpoint: it has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ModelLoadError(f"{config_file} is not valid JSON: {err}") from None
        config = cls.from_dict(raw)
        quant = quant_config(raw, path)
        method = check_method(quant)
        if quant is None or method not in GROUP_METHODS:
            return config
        meta = tensor_meta(checkpoint_files(path))
        return replace(config, quant_schemes=schemes_from_meta(method, quant, meta))


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


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
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
    )


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. `dtype=None` means float32 on CPU and bfloat16 on CUDA.

    `kv_capacity` is the number of tokens the KV pool holds per rank (rounded up to whole blocks).
    `max_model_len=None` takes the smaller of the model's position limit and the pool.
    `prefill_chunk_tokens` bounds the prompt tokens computed per step, so decodes keep running
    while a long prompt is prefilled. With `prefix_cache`, requests reuse cached KV blocks of
    earlier ones; prompts shorter than `prefix_min_tokens` may hit the cache but add nothing to it
    (short requests would otherwise evict long, valuable agent histories). For models with
    recurrent layers (Qwen3-Next) a hit also needs a snapshot of their state; `prefix_cache_gib`
    is the memory each rank gives those snapshots (`dgpp.engine.state_snapshots`).

    `memory_fraction` (like vLLM's `--gpu-memory-utilization`) bounds what this rank may use of the
    device's memory (host RAM on CPU); when set, the KV pool is sized from what the weights and
    workspace leave of it instead of from `kv_capacity`. `mlock` pins the process's memory.
    `resident_cache` keeps each rank's final weight tensors as one image under
    `resident_cache_dir` (default `~/.cache/dgpp/resident`), so a restart skips the checkpoint.

    `speculative="ngram"` drafts up to `spec_depth` tokens per decode step by looking the last
    `spec_ngram_max` .. `spec_ngram_min` tokens up in the request's own history, and verifies them
    in one forward; what is generated does not change (`dgpp.engine.speculative`).
    """

    model: str
    dtype: str | None = None
    device: str = "cpu"
    prefill_precision: PrefillPrecision = "fp32"
    kv_capacity: int = 16384
    block_size: int = 16
    max_model_len: int | None = None
    max_concurrency: int = 64
    prefill_chunk_tokens: int = 512
    # The interactive step policy (dgpp.engine.step_policy): prompts with at most this many
    # tokens left go first; the oldest long prompt keeps this share of the budget while they
    # wait; steps with prompt work stay near this time while streams decode (0: twice the
    # decode-only step; negative: unbounded).
    short_prompt_tokens: int = 256
    long_prefill_share: float = 0.25
    step_target_ms: float = 0.0
    prefix_cache: bool = True
    prefix_min_tokens: int = 1024
    # Hybrid models: memory for the prefix cache's snapshots of recurrent state (per rank).
    prefix_cache_gib: float = 4.0
    seed: int | None = None
    num_threads: int | None = None
    tokenizer: str | None = None
    memory_fraction: float | None = None
    mlock: bool = False
    resident_cache: bool = True
    resident_cache_dir: str | None = None
    speculative: Speculative = "off"
    # "auto" serves the checkpoint as it is stored; naming a method (or "none") refuses a
    # checkpoint stored otherwise, before loading (vLLM's --quantization)
    quantization: str = "auto"
    spec_depth: int = 4
    spec_ngram_max: int = 4
    spec_ngram_min: int = 2

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.prefill_precision not in ("fp32", "model"):
            raise ConfigError(
                f"prefill_precision must be 'fp32' or 'model', got {self.prefill_precision!r}"
            )
        if not 0.0 < self.long_prefill_share <= 1.0:
            raise ConfigError(
                f"long_prefill_share must be in (0, 1], got {self.long_prefill_share!r}"
            )
        for name in (
            "kv_capacity",
            "block_size",
            "max_concurrency",
            "prefill_chunk_tokens",
            "short_prompt_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.prefix_min_tokens, bool) or not isinstance(self.prefix_min_tokens, int):
            raise ConfigError(
                f"prefix_min_tokens must be an integer, got {self.prefix_min_tokens!r}"
            )
        if self.prefix_min_tokens < 0:
            raise ConfigError(f"prefix_min_tokens must be >= 0, got {self.prefix_min_tokens}")
        gib = self.prefix_cache_gib
        if isinstance(gib, bool) or not isinstance(gib, int | float) or not 0 <= gib < 1 << 20:
            raise ConfigError(f"prefix_cache_gib must be a number >= 0, got {gib!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.speculative not in ("off", "ngram"):
            raise ConfigError(f"speculative must be 'off' or 'ngram', got {self.speculative!r}")
        for name in ("spec_depth", "spec_ngram_max", "spec_ngram_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.spec_ngram_min > self.spec_ngram_max:
            raise ConfigError(
                f"spec_ngram_min ({self.spec_ngram_min}) must not exceed "
                f"spec_ngram_max ({self.spec_ngram_max})"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be positive, got {self.num_threads}")

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_capacity // self.block_size)

    @property
    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def effective_max_model_len(self, model: ModelConfig) -> int:
        pool_tokens = self.num_kv_blocks * self.block_size
        limit = min(model.max_position_embeddings, pool_tokens)
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds what this model and KV pool allow "
                f"({limit}: position limit {model.max_position_embeddings}, "
                f"pool {pool_tokens} tokens)"
            )
        return self.max_model_len
