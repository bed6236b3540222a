"""DeepSeek-V4's configuration as dgpp reads it, in transformers' spelling and the release's
(`compress_ratios`, `compress_rate_csa`/`_hca`, `qk_rope_head_dim`, a flat YaRN `rope_scaling`).

- Layer kinds: `layer_types` (sliding, compressed sparse, heavily compressed), else the
  release's `compress_ratios` per layer (0 sliding, 4 compressed sparse, 128 heavily
  compressed), else transformers' default (two heavily compressed layers, then alternating).
- Two rotary sets (docs/deepseek_v4.md, section 1): "main" for the sliding layers (plain, the
  model's `rope_theta`) and "compress" for the compressing layers and their compressors and
  indexers (`compress_rope_theta`, the checkpoint's YaRN scaling with cos/sin unscaled).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dgpp.engine.checkpoint.config import ModelConfig, RopeConfig, parse_rope
from dgpp.engine.errors import ModelLoadError

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}


@dataclasses.dataclass(frozen=True)
class V4Dims:
    """The attention's shapes (docs/deepseek_v4.md's notation)."""

    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_rank: int
    o_groups: int
    o_rank: int
    window: int
    eps: float
    index_heads: int
    index_dim: int
    index_topk: int
    layer_types: tuple[str, ...]
    rates: Mapping[str, int]

    @classmethod
    def of(cls, config: ModelConfig) -> V4Dims:
        raw = config.raw
        head_dim = int(raw.get("head_dim") or 512)
        if raw.get("qk_rope_head_dim"):
            rope_dim = int(raw["qk_rope_head_dim"])
        else:
            rope_dim = int(head_dim * float(raw.get("partial_rotary_factor") or 0.125))
        rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
        if raw.get("compress_rate_csa"):
            rates[CSA] = int(raw["compress_rate_csa"])
        if raw.get("compress_rate_hca"):
            rates[HCA] = int(raw["compress_rate_hca"])
        try:
            return cls(
                hidden=config.hidden_size,
                heads=config.num_heads,
                head_dim=head_dim,
                rope_dim=rope_dim,
                q_rank=int(raw["q_lora_rank"]),
                o_groups=int(raw["o_groups"]),
                o_rank=int(raw["o_lora_rank"]),
                window=int(raw.get("sliding_window") or 128),
                eps=config.rms_norm_eps,
                index_heads=int(raw.get("index_n_heads") or 64),
                index_dim=int(raw.get("index_head_dim") or 128),
                index_topk=int(raw.get("index_topk") or 512),
                layer_types=layer_types(raw, config.num_layers),
                rates={kind: int(rate) for kind, rate in rates.items()},
            )
        except KeyError as missing:
            raise ModelLoadError(f"DeepSeek-V4's config.json lacks {missing}") from None

    def rate(self, index: int) -> int:
        """Layer `index`'s compression rate (0: a sliding layer, no compressor)."""
        kind = self.layer_types[index]
        return 0 if kind == SLIDING else self.rates[kind]


def layer_types(raw: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    if raw.get("layer_types"):
        kinds = tuple(str(kind) for kind in raw["layer_types"][:layers])
    elif raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])[:layers]
        unknown = sorted({int(r) for r in ratios} - set(_RATIO_KIND))
        if unknown:
            raise ModelLoadError(f"DeepSeek-V4 compress_ratios {unknown} (only 0, 4 and 128)")
        kinds = tuple(_RATIO_KIND[int(r)] for r in ratios)
    else:
        interleave = [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
        kinds = tuple([HCA] * min(layers, 2) + interleave)
    if len(kinds) != layers or set(kinds) - {SLIDING, CSA, HCA}:
        raise ModelLoadError(f"DeepSeek-V4's layer types {list(kinds)} for {layers} layers")
    return kinds


def v4_ropes(raw: Mapping[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) rotary parameters."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping):
        main, compress = parse_rope(raw, "main"), parse_rope(raw, "compress")
    else:
        flat = {key: v for key, v in {**(raw.get("rope_scaling") or {}), **params}.items()}
        main = RopeConfig(theta=float(raw.get("rope_theta") or 10000.0))
        theta = float(raw.get("compress_rope_theta") or 160000.0)
        compress = parse_rope({**raw, "rope_parameters": {**flat, "rope_theta": theta}})
    if compress.rope_type == "yarn" and compress.attention_factor is None:
        compress = dataclasses.replace(compress, attention_factor=1.0)  # the reference's
    return main, dataclasses.replace(compress, truncate=True)
