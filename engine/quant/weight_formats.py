"""Which weights a checkpoint stores packed, as the model's layers and the memory plan see it.

A GGUF view's config.json carries `quantization_config = {"quant_method": "gguf",
"weight_formats": {<module name>: <GGML type>}}` for every 2-D weight. A layer that fuses several
checkpoint modules (q/k/v, gate/up) is packed when they all share one format the kernels read
(`PACKED_FORMATS`) and this rank's slice of its input splits at block boundaries; otherwise its
weights are dequantized at load into the run dtype, as a dense checkpoint's would be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dgpp.engine.errors import ModelLoadError
from dgpp.engine.layers.head_partition import partition_heads
from dgpp.engine.quant.ggml_blocks import FORMATS

if TYPE_CHECKING:
    from dgpp.engine.config import ModelConfig
    from dgpp.engine.memory_plan import RankShapes

PACKED_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0"})  # kernels/ggml_linear.py: CPU_FORMATS
QUANT_METHODS = ("gguf",)


@dataclass(frozen=True)
class WeightFormats:
    """Module name (`model.layers.0.self_attn.q_proj`, `model.embed_tokens`) -> GGML type."""

    items: tuple[tuple[str, str], ...] = ()  # sorted pairs: hashable, like ModelConfig

    @property
    def formats(self) -> Mapping[str, str]:
        return dict(self.items)

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> WeightFormats:
        quant = raw.get("quantization_config")
        if not quant:
            return cls()
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method not in QUANT_METHODS:
            raise ModelLoadError(
                f"quantization method {method!r} is not supported; supported: "
                + ", ".join(QUANT_METHODS)
            )
        formats = quant.get("weight_formats") or {}
        unknown = sorted({f for f in formats.values() if f not in FORMATS})
        if unknown:
            raise ModelLoadError(
                f"GGUF types {', '.join(unknown)} are not supported; supported: "
                + ", ".join(FORMATS)
            )
        return cls(tuple(sorted(formats.items())))

    def __bool__(self) -> bool:
        return bool(self.items)

    def packed(self, modules: Sequence[str], in_start: int = 0, in_size: int = 0) -> str | None:
        """The format a layer made of `modules` keeps packed, or None to load it dense. With
        `in_size`, this rank reads input columns in_start .. in_start + in_size only."""
        formats = self.formats
        found = {formats.get(name) for name in modules}
        if len(found) != 1:
            return None
        (fmt,) = found
        if fmt not in PACKED_FORMATS:
            return None
        block = FORMATS[fmt].block_size
        if in_size and (in_start % block or in_size % block):
            return None
        return fmt


def packed_bytes(fmt: str, rows: int, cols: int) -> int:
    spec = FORMATS[fmt]
    return rows * (cols // spec.block_size) * spec.type_size


def packed_savings(
    model: ModelConfig, shapes: RankShapes, dtype_bytes: int, tp_size: int, tp_rank: int
) -> int:
    """Bytes one rank saves by keeping packed weights in their blocks (GGUF) instead of the run
    dtype: the layers `quant.weight_formats` packs, as the model builds them."""
    formats = model.weight_formats
    if not formats:
        return 0
    hidden, head_dim, inter = model.hidden_size, model.head_dim, shapes.intermediate_size
    heads = partition_heads(model.num_heads, model.num_kv_heads, tp_size, tp_rank)
    qkv_rows = (shapes.num_heads + 2 * shapes.num_kv_heads) * head_dim
    q_cols = (heads.q_start * head_dim, heads.num_q * head_dim)
    groups: list[tuple[str | None, int, int]] = []
    for index in range(model.num_layers):
        attn, mlp = f"model.layers.{index}.self_attn", f"model.layers.{index}.mlp"
        groups += [
            (
                formats.packed([f"{attn}.{n}" for n in ("q_proj", "k_proj", "v_proj")]),
                qkv_rows,
                hidden,
            ),
            (formats.packed([f"{attn}.o_proj"], *q_cols), hidden, q_cols[1]),
            (formats.packed([f"{mlp}.gate_proj", f"{mlp}.up_proj"]), 2 * inter, hidden),
            (formats.packed([f"{mlp}.down_proj"], tp_rank * inter, inter), hidden, inter),
        ]
    groups.append((formats.packed(["model.embed_tokens"]), shapes.vocab_rows, hidden))
    if not model.tie_word_embeddings:
        groups.append((formats.packed(["lm_head"]), shapes.vocab_rows, hidden))
    return sum(
        rows * cols * dtype_bytes - packed_bytes(fmt, rows, cols)
        for fmt, rows, cols in groups
        if fmt is not None
    )
