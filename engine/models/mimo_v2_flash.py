"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`): a decoder whose layers mix full attention with
sliding-window attention (five windowed layers to one full one), over a GLM-4.5-style MoE.

- Windowed layers: a window of `sliding_window` keys (the query included; the release's
  `sliding_window_size` is 128, so 129), twice the key/value heads of the full layers, a learned
  sink per query head, and rotary of their own base (`swa_rope_theta`, 10,000 against the full
  layers' 5,000,000); both rotate the first third of each head (`partial_rotary_factor`).
- The windowed layers keep their keys and values as a per-request state of the last
  `window - 1` tokens (`layers.window_kv`), not in the paged pool: only the nine full layers of
  48 cache every position, about a tenth of the bytes per token of caching all layers.
- Query and key heads of 192 dims, value heads of 128 (`v_head_dim`), the values scaled by
  `attention_value_scale` before they are cached. The paged pool keeps one width for keys and
  values, so a full layer pages both at the wider of the two, the narrower padded with zeros:
  values padded to the keys' width add nothing to the output (20% more than keys and values
  kept apart, for the release); where `v_head_dim` is the wider (transformers accepts it), the
  queries and keys are padded instead, which adds nothing to a score (the scale stays
  `head_dim ** -0.5`). The windowed layers' states keep each at its own width.
- The MLP: dense in the first layer, else routed experts only (no shared experts) behind
  DeepSeek-V3's sigmoid router with correction bias.

The release's config.json spells the layer pattern and the windowed layers' shapes its own way
(`hybrid_layer_pattern`, `moe_layer_freq`, `swa_num_key_value_heads`, `swa_rope_theta`,
`add_swa_attention_sink_bias`); transformers' spelling (`layer_types`, `mlp_layer_types`,
`rope_parameters` per layer type) and its defaults are read as well. The MTP layers the release
appends (`model.mtp.*`) are not loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend, StepMetadata
from dgpp.engine.backends.cache_spec import CacheSpec, PagedKVSpec
from dgpp.engine.backends.state_cache import LinearStateBackend
from dgpp.engine.checkpoint.config import ModelConfig, parse_rope
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.attention import PagedAttention
from dgpp.engine.layers.head_partition import partition_heads
from dgpp.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from dgpp.engine.layers.moe import expert_target
from dgpp.engine.layers.rotary import RopeAngles, RotaryEmbedding, rotate_leading
from dgpp.engine.layers.window_kv import WindowAttention, WindowStateSpec
from dgpp.engine.models.gpt_oss import gpt_oss_target
from dgpp.engine.models.llama import DecoderLayer, DecoderModel, LlamaForCausalLM
from dgpp.engine.models.moe_blocks import moe_mlp
from dgpp.engine.models.moe_config import grouped_moe_spec

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class MimoLayout:
    """Which layers are windowed, and the windowed layers' differences, from either spelling."""

    layer_types: tuple[str, ...]
    dense_layers: frozenset[int]
    window: int
    sliding_kv_heads: int
    full_sinks: bool
    sliding_sinks: bool
    v_head_dim: int
    value_scale: float

    @classmethod
    def of(cls, config: ModelConfig) -> MimoLayout:
        raw, layers = config.raw, config.num_layers
        pattern = raw.get("hybrid_layer_pattern")
        if raw.get("layer_types"):
            types = tuple(str(kind) for kind in raw["layer_types"])
        elif pattern:
            types = tuple(SLIDING if int(flag) else FULL for flag in pattern)
        else:  # transformers' default: full attention in the first and every sixth layer
            types = tuple(FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(layers))
        if len(types) != layers or set(types) - {SLIDING, FULL}:
            raise ModelLoadError(f"MiMo-V2-Flash's layer types {list(types)} for {layers} layers")
        if raw.get("mlp_layer_types"):
            dense = {i for i, kind in enumerate(raw["mlp_layer_types"]) if kind == "dense"}
        elif raw.get("moe_layer_freq") is not None and isinstance(raw["moe_layer_freq"], list):
            dense = {i for i, flag in enumerate(raw["moe_layer_freq"]) if not int(flag)}
        else:
            dense = {0}
        if raw.get("sliding_window_size") is not None:  # the release's: the window less the query
            window = int(raw["sliding_window_size"]) + 1
        else:
            window = int(raw.get("sliding_window") or 129)
        for key, same in (
            ("swa_num_attention_heads", config.num_heads),
            ("swa_head_dim", config.head_dim),
        ):
            if raw.get(key) is not None and int(raw[key]) != same:
                raise ModelLoadError(f"MiMo-V2-Flash with {key}={raw[key]} (only {same})")
        v_head_dim = int(raw.get("v_head_dim") or config.head_dim)
        if int(raw.get("swa_v_head_dim") or v_head_dim) != v_head_dim:
            raise ModelLoadError("MiMo-V2-Flash with windowed value heads of another width")
        scale = raw.get("attention_value_scale")
        return cls(
            layer_types=types,
            dense_layers=frozenset(dense),
            window=window,
            sliding_kv_heads=int(raw.get("swa_num_key_value_heads") or 2 * config.num_kv_heads),
            full_sinks=bool(raw.get("add_full_attention_sink_bias", False)),
            sliding_sinks=bool(raw.get("add_swa_attention_sink_bias", True)),
            v_head_dim=v_head_dim,
            value_scale=1.0 if scale is None else float(scale),
        )

    def kv_heads(self, config: ModelConfig, index: int) -> int:
        return self.sliding_kv_heads if self.layer_types[index] == SLIDING else config.num_kv_heads

    def sliding_rope(self, config: ModelConfig) -> Any:
        """The windowed layers' rotary: transformers' per-type parameters, else the release's
        `swa_rope_theta` over the full layers' (10,000 where neither says)."""
        params = config.raw.get("rope_parameters") or {}
        if isinstance(params.get(SLIDING), Mapping):
            return parse_rope(config.raw, SLIDING)
        theta = config.raw.get("swa_rope_theta") or 10000.0
        return dataclasses.replace(config.rope, theta=float(theta))


class MimoAttention(nn.Module):
    """Attention with value heads of another width than query/key heads (narrower in the
    release, wider allowed), values scaled, and (windowed layers) a sliding window and sinks."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: PagedAttentionBackend,
        state_backend: LinearStateBackend,
        layout: MimoLayout,
        index: int,
        prefix: str,
    ) -> None:
        super().__init__()
        sliding = layout.layer_types[index] == SLIDING
        kv_heads, dim, v_dim = layout.kv_heads(config, index), config.head_dim, layout.v_head_dim
        names = [f"{prefix}.{name}" for name in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            dim,
            config.num_heads,
            kv_heads,
            config.qkv_bias,
            parallel,
            config.weight_format(names, config.hidden_size),
            v_head_dim=v_dim,
        )
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        self.head_dim, self.v_head_dim = dim, v_dim
        self.value_scale = layout.value_scale
        self.paged_dim = max(dim, v_dim)  # the full layers' one width for keys and values
        columns = (heads.q_start * v_dim, heads.num_q * v_dim)
        total = config.num_heads * v_dim
        self.o_proj = RowParallelLinear(
            total,
            config.hidden_size,
            False,
            parallel,
            input_range=columns,
            weight_format=config.weight_format([f"{prefix}.o_proj"], columns[1], columns[0], total),
        )
        sinks = layout.sliding_sinks if sliding else layout.full_sinks
        self.attn: PagedAttention | WindowAttention
        if sliding:
            self.attn = WindowAttention(
                self.num_heads,
                self.num_kv_heads,
                dim,
                v_dim,
                dim**-0.5,
                layout.window,
                state_backend,
                has_sinks=sinks,
                first_head=heads.q_start,
            )
        else:
            self.attn = PagedAttention(
                self.num_heads,
                self.num_kv_heads,
                self.paged_dim,
                dim**-0.5,
                backend,
                has_sinks=sinks,
                first_head=heads.q_start,
            )

    def forward(
        self, angles: RopeAngles, hidden: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        tokens, dim, v_dim = hidden.shape[0], self.head_dim, self.v_head_dim
        widths = [self.num_heads * dim, self.num_kv_heads * dim, self.num_kv_heads * v_dim]
        q, k, v = self.qkv_proj(hidden).split(widths, dim=-1)
        q = rotate_leading(q.reshape(tokens, self.num_heads, dim), angles)
        k = rotate_leading(k.reshape(tokens, self.num_kv_heads, dim), angles)
        v = v.reshape(tokens, self.num_kv_heads, v_dim) * self.value_scale
        if isinstance(self.attn, WindowAttention):
            out = self.attn(q, k, v, metadata)
        else:  # the paged pool keeps one width: the narrower side padded, the padding cut
            q, k, v = (self._widen(part) for part in (q, k, v))
            out = self.attn(q, k, v, metadata)[..., :v_dim]
        return self.o_proj(out.reshape(tokens, self.num_heads * v_dim))

    def _widen(self, heads: torch.Tensor) -> torch.Tensor:
        """`heads` [T, H, width] zero-padded to the paged pool's width (as it is where equal)."""
        short = self.paged_dim - heads.shape[-1]
        return F.pad(heads, (0, short)) if short else heads


class MimoDecoderModel(DecoderModel):
    """The decoder with a second rotary table for the windowed layers."""

    local_rotary: RotaryEmbedding
    local_layers: frozenset[int]

    def layer_angles(self, positions: torch.Tensor, dtype: torch.dtype) -> Sequence[RopeAngles]:
        full = self.rotary.lookup(positions, dtype)
        local = self.local_rotary.lookup(positions, dtype)
        return [local if i in self.local_layers else full for i in range(len(self.layers))]


def mimo_checkpoint_name(name: str) -> str | None:
    """Skips the MTP layers; the release's sink name as transformers' (`sinks`)."""
    if name.startswith("model.mtp."):
        return None
    return name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")


def mimo_target(name: str) -> tuple[str, Any] | None:
    """The sinks live in the attention's inner layer (as gpt-oss's); the experts as the MoE
    blocks keep them."""
    return gpt_oss_target(name) or expert_target(name)


class MiMoV2FlashForCausalLM(LlamaForCausalLM):
    decoder_model = MimoDecoderModel
    checkpoint_name = staticmethod(mimo_checkpoint_name)
    checkpoint_target = staticmethod(mimo_target)

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        self.layout = MimoLayout.of(config)
        device = getattr(attention, "device", torch.device("cpu"))
        self._state_backend = LinearStateBackend(device, getattr(attention, "kv_dtype", "auto"))
        super().__init__(config, parallel, max_position, attention)
        model = self.model
        assert isinstance(model, MimoDecoderModel)
        rope = self.layout.sliding_rope(config)
        model.local_rotary = RotaryEmbedding(config.rotary_dim, max_position, rope)
        types = self.layout.layer_types
        model.local_layers = frozenset(i for i, kind in enumerate(types) if kind == SLIDING)

    def build_layer(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        index: int,
        prefix: str,
    ) -> nn.Module:
        self_attn = MimoAttention(
            config,
            parallel,
            attention,
            self._state_backend,
            self.layout,
            index,
            f"{prefix}.self_attn",
        )
        spec = dataclasses.replace(
            grouped_moe_spec(config.raw), dense_layers=self.layout.dense_layers, first_dense=0
        )
        mlp = moe_mlp(config, parallel, spec, index, f"{prefix}.mlp")
        return DecoderLayer(config, self_attn, mlp)

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """The full-attention layers' keys and values, both at the wider of the key and value
        widths (`MimoAttention.paged_dim`)."""
        layout, rank = MimoLayout.of(config), (parallel.tp_size, parallel.tp_rank)
        heads = partition_heads(config.num_heads, config.num_kv_heads, *rank)
        full = layout.layer_types.count(FULL)
        width = max(config.head_dim, layout.v_head_dim)
        return [PagedKVSpec(heads.num_kv, width)] * full

    @classmethod
    def state_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[Any]:
        """The windowed layers' last `window - 1` keys and values per request."""
        layout, rank = MimoLayout.of(config), (parallel.tp_size, parallel.tp_rank)
        heads = partition_heads(config.num_heads, layout.sliding_kv_heads, *rank)
        spec = WindowStateSpec(heads.num_kv, config.head_dim, layout.v_head_dim, layout.window - 1)
        return [spec] * layout.layer_types.count(SLIDING)
