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
from functools import cached_property
from typing import Any

from dgpp.engine.errors import ModelLoadError
from dgpp.kernels.ggml_blocks import FORMATS

PACKED_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0"})  # kernels/ggml_linear.py: CPU_FORMATS


@dataclass(frozen=True)
class WeightFormats:
    """Module name (`model.layers.0.self_attn.q_proj`, `model.embed_tokens`) -> GGML type."""

    items: tuple[tuple[str, str], ...] = ()  # sorted pairs: hashable, like ModelConfig

    @cached_property  # built once: looked up for every layer and checkpoint tensor
    def formats(self) -> Mapping[str, str]:
        return dict(self.items)

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> WeightFormats:
        quant = raw.get("quantization_config")
        if not quant:
            return cls()
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method != "gguf":
            return cls()  # other methods: quant.quant_schemes
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
