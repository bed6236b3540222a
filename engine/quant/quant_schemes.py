"""Which linear modules a quantized safetensors checkpoint stores packed, and how.

The checkpoint's `quantization_config` (or ModelOpt's `hf_quant_config.json`) names the method;
the tensors themselves say which modules it covers: a module is quantized when its packed tensors
are there (`qweight`, `weight_packed`, `weight_scale_inv`, ...), so every writer's way of listing
exceptions (`ignore`, `modules_to_not_convert`, `extra_config`, `exclude_modules`) is honoured by
construction. Only safetensors headers are read here (names, dtypes, shapes), never the data.
Conversions of the tensors: `quant.checkpoint_formats`; the packed form: `quant.group_codes`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from safetensors import safe_open

from dgpp.engine.errors import ModelLoadError
from dgpp.engine.quant.methods import METHODS
from dgpp.kernels.group_codes import Codebook, GlobalMode, GroupFormat

CT_FORMATS = (
    "pack-quantized",
    "float-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "mixed-precision",
    "dense",
)
# Checkpoint tensors of a quantized module that serving does not read: static activation scales
# (activations are scaled dynamically), compressed-tensors' shape record. (Static KV scales are
# read: `checkpoint.kv_scales`.)
IGNORED_SUFFIXES = frozenset(
    {"input_scale", "input_global_scale", "input_zero_point", "weight_shape"}
)

TensorMeta = Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


@dataclass(frozen=True)
class LayerScheme:
    """How one module's checkpoint tensors encode its weight (see `checkpoint_formats`)."""

    layout: str  # gptq | awq | ct-int4 | fp8 | nvfp4 | mxfp4
    codebook: Codebook
    group_size: int  # columns per scale; 0: one scale per row
    scale_dtype: str
    suffixes: tuple[str, ...]  # the module's tensors this layout reads
    zeros: bool = False
    global_mode: GlobalMode | None = None
    zero_offset: bool = False  # GPTQ v1 stores zero - 1
    act_order: bool = False
    block: tuple[int, int] = (1, 1)  # FP8 block scales (rows, cols)
    scale_name: str = "weight_scale"
    codes_name: str = "weight_packed"

    def group_format(self, cols: int) -> GroupFormat:
        """The packed form of a [rows, cols] piece of this module's weight."""
        return GroupFormat(
            self.codebook,
            self.group_size or cols,
            self.global_mode,
            self.scale_dtype,
            self.zeros,
            self.act_order,
        )

    def describe(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        if self.layout == "fp8" and self.block != (1, 1):
            group = f"block {self.block[0]}x{self.block[1]}"
        return f"{self.layout} {group}" + (" act-order" if self.act_order else "")


@dataclass(frozen=True)
class QuantSchemes:
    """Module name (`model.layers.0.mlp.down_proj`) -> LayerScheme, for one checkpoint."""

    method: str = ""
    items: tuple[tuple[str, LayerScheme], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.items)

    @cached_property  # built once: looked up for every layer and checkpoint tensor
    def schemes(self) -> Mapping[str, LayerScheme]:
        return dict(self.items)

    def of(self, module: str) -> LayerScheme | None:
        return self.schemes.get(module)

    def group_format(
        self, modules: Sequence[str], cols: int, in_start: int = 0, in_total: int = 0
    ) -> GroupFormat | None:
        """The packed form of a layer fusing `modules` whose rank reads `cols` input columns
        (in_start .. in_start + cols of `in_total` when the input is split), or None to load it
        dense: modules quantized differently, a split through a scale group, or act order on a
        split input (its groups are spread over every column)."""
        schemes = self.schemes
        found = {schemes.get(name) for name in modules}
        if len(found) != 1 or None in found:
            return None
        (scheme,) = found
        assert scheme is not None
        fmt = scheme.group_format(cols)
        split = in_total not in (0, cols)
        if split and (in_start % fmt.group_size or cols % fmt.group_size or scheme.act_order):
            return None
        return fmt

    def describe(self) -> str:
        kinds = sorted({scheme.describe() for _, scheme in self.items})
        return f"{self.method}: " + ", ".join(kinds) if kinds else self.method


def quant_config(raw: dict[str, Any], path: Path | None = None) -> dict[str, Any] | None:
    """config.json's `quantization_config`, or ModelOpt's `hf_quant_config.json` beside it."""
    quant = raw.get("quantization_config")
    if isinstance(quant, dict):
        return quant
    if path is not None and (path / "hf_quant_config.json").is_file():
        try:
            modelopt = json.loads((path / "hf_quant_config.json").read_text())
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot read hf_quant_config.json: {err}") from None
        return {"quant_method": "modelopt", **(modelopt.get("quantization") or {})}
    return None


def canonical_method(quant: dict[str, Any]) -> str:
    """`quant_method` as dgpp names it (spellings differ between writers)."""
    method = str(quant.get("quant_method", "")).lower().replace("_", "-")
    if method in ("auto-round", "intel/auto-round"):
        return "auto-round"
    if method == "modelopt-fp4":  # ModelOpt's NVFP4 exports in transformers' naming
        quant.setdefault("quant_algo", "NVFP4")
        return "modelopt"
    return method


def check_method(quant: dict[str, Any] | None) -> str | None:
    """The quantization method, refused before loading when dgpp cannot serve it."""
    if quant is None:
        return None
    method = canonical_method(quant)
    if method not in METHODS:
        raise ModelLoadError(
            f"quantization method {quant.get('quant_method')!r} is not supported; supported: "
            + ", ".join(METHODS)
        )
    bits = quant.get("bits", quant.get("w_bit"))
    if method in ("gptq", "awq", "auto-round") and bits is not None and int(bits) != 4:
        raise ModelLoadError(f"{method} with {bits}-bit weights is not supported; supported: 4")
    if method == "awq" and str(quant.get("version", "gemm")).lower() != "gemm":
        raise ModelLoadError(f"AWQ version {quant.get('version')!r} is not supported: only GEMM")
    if method == "compressed-tensors":
        fmt = quant.get("format", "dense")
        if fmt not in CT_FORMATS:
            raise ModelLoadError(
                f"compressed-tensors format {fmt!r} is not supported; supported: "
                + ", ".join(CT_FORMATS)
            )
        for name, group in (quant.get("config_groups") or {}).items():
            weights = (group or {}).get("weights") or {}
            kind = (str(weights.get("type", "int")), int(weights.get("num_bits", 4)))
            if kind not in (("int", 4), ("float", 8), ("float", 4)):
                raise ModelLoadError(
                    f"compressed-tensors group {name!r} has {kind[1]}-bit {kind[0]} weights; "
                    "supported: 4-bit int, 8-bit float (FP8), 4-bit float (NVFP4, MXFP4)"
                )
    if method == "modelopt" and str(quant.get("quant_algo", "")).upper() not in ("NVFP4", "FP8"):
        raise ModelLoadError(
            f"ModelOpt quant_algo {quant.get('quant_algo')!r} is not supported; supported: "
            "NVFP4, FP8"
        )
    return method


def check_quantization(expected: str, stored: str) -> None:
    """Refuse a checkpoint whose quantization is not the one the configuration names (the knob
    admits only auto, none and `METHODS`)."""
    if expected not in ("auto", stored):
        raise ModelLoadError(
            f"the configuration asks for quantization {expected!r}, but the checkpoint's weights "
            f"are stored as {stored!r}; set it to auto or {stored!r}",
            param="quantization",
        )


def tensor_meta(files: Iterable[Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's safetensors dtype and shape, read from the file headers."""
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    piece = handle.get_slice(name)
                    meta[name] = (piece.get_dtype(), tuple(piece.get_shape()))
        except Exception as err:
            raise ModelLoadError(f"cannot read {file}: {err}") from None
    return meta


def _modules(meta: TensorMeta) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    modules: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, info in meta.items():
        module, _, suffix = name.rpartition(".")
        modules.setdefault(module, {})[suffix] = info
    return modules


def _int4(method: str, quant: dict[str, Any], tensors: Mapping[str, Any]) -> LayerScheme | None:
    """GPTQ / AWQ / AutoRound int4, when the module has a `qweight`."""
    if "qweight" not in tensors:
        return None
    packing = str(quant.get("packing_format", "auto_round:auto_gptq"))
    layout = "awq" if method == "awq" or (method == "auto-round" and "awq" in packing) else "gptq"
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    scale_dtype = _torch_dtype(tensors["scales"][0])
    act_order = layout == "gptq" and bool(quant.get("desc_act")) and "g_idx" in tensors
    suffixes = ("qweight", "qzeros", "scales") + (("g_idx",) if "g_idx" in tensors else ())
    return LayerScheme(
        layout,
        "uint4",
        max(group, 0),
        scale_dtype,
        suffixes,
        zeros=True,
        zero_offset=layout == "gptq" and quant.get("checkpoint_format", "gptq") != "gptq_v2",
        act_order=act_order,
    )


def _compressed(quant: dict[str, Any], tensors: Mapping[str, Any]) -> LayerScheme | None:
    """compressed-tensors: int4 packs, NVFP4, MXFP4 and FP8, told apart by their tensors."""
    if "weight_packed" in tensors:
        packed_dtype, packed_shape = tensors["weight_packed"]
        scale_dtype, scale_shape = tensors["weight_scale"]
        if packed_dtype == "I32":
            cols = packed_shape[1] * 8
            group = cols // scale_shape[1] if scale_shape[1] > 1 else 0
            zeros = "weight_zero_point" in tensors
            suffixes = ("weight_packed", "weight_scale") + (("weight_zero_point",) if zeros else ())
            codebook: Codebook = "uint4" if zeros else "int4"
            return LayerScheme(
                "ct-int4", codebook, group, _torch_dtype(scale_dtype), suffixes, zeros=zeros
            )
        if "weight_global_scale" in tensors:
            suffixes = ("weight_packed", "weight_scale", "weight_global_scale")
            return LayerScheme("nvfp4", "e2m1", 16, "float16", suffixes, global_mode="div")
        return LayerScheme("mxfp4", "e2m1", 32, "bfloat16", ("weight_packed", "weight_scale"))
    return _fp8(tensors, "weight_scale", _ct_block(quant))


def _ct_block(quant: dict[str, Any]) -> tuple[int, int] | None:
    for group in (quant.get("config_groups") or {}).values():
        structure = ((group or {}).get("weights") or {}).get("block_structure")
        if structure:
            return int(structure[0]), int(structure[1])
    return None


def _fp8(
    tensors: Mapping[str, Any], scale_name: str, block: tuple[int, int] | None
) -> LayerScheme | None:
    if scale_name not in tensors or tensors.get("weight", ("",))[0] != "F8_E4M3":
        return None
    rows, cols = tensors["weight"][1]
    scale_shape = tensors[scale_name][1]
    # Block scales: several column blocks, or one (a weight no wider than a block) over
    # fewer rows than the weight has.
    blocked = len(scale_shape) == 2 and (
        scale_shape[1] > 1 or (block is not None and scale_shape[0] != rows)
    )
    if blocked:
        if block is None:
            block = (-(-rows // scale_shape[0]), -(-cols // scale_shape[1]))
        return LayerScheme(
            "fp8",
            "e4m3",
            block[1],
            "float32",
            ("weight", scale_name),
            block=block,
            scale_name=scale_name,
        )
    return LayerScheme("fp8", "e4m3", 0, "float32", ("weight", scale_name), scale_name=scale_name)


def _modelopt(quant: dict[str, Any], tensors: Mapping[str, Any]) -> LayerScheme | None:
    if str(quant.get("quant_algo", "")).upper() == "FP8":
        return _fp8(tensors, "weight_scale", None)
    if "weight_scale_2" not in tensors or tensors.get("weight", ("",))[0] != "U8":
        return None
    suffixes = ("weight", "weight_scale", "weight_scale_2")
    group = int(quant.get("group_size", 16))
    return LayerScheme(
        "nvfp4", "e2m1", group, "float16", suffixes, global_mode="mul", codes_name="weight"
    )


def _torch_dtype(safetensors_dtype: str) -> str:
    return {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}.get(
        safetensors_dtype, "float32"
    )


def schemes_from_meta(method: str, quant: dict[str, Any], meta: TensorMeta) -> QuantSchemes:
    """The scheme of every quantized module among `meta`'s tensors."""
    found: list[tuple[str, LayerScheme]] = []
    for module, tensors in sorted(_modules(meta).items()):
        if method in ("gptq", "awq", "auto-round"):
            scheme = _int4(method, quant, tensors)
        elif method == "compressed-tensors":
            scheme = _compressed(quant, tensors)
        elif method == "fp8":
            block = quant.get("weight_block_size")
            scale = "weight_scale_inv" if block else "weight_scale"
            if scale not in tensors and "scale" in tensors:
                scale = "scale"  # DeepSeek-V4's block scales (E8M0)
            scheme = _fp8(tensors, scale, (int(block[0]), int(block[1])) if block else None)
        else:
            scheme = _modelopt(quant, tensors)
        if scheme is not None:
            found.append((module, scheme))
    return QuantSchemes(method, tuple(found))


def describe_quantization(raw: dict[str, Any], path: Path | None = None) -> str:
    """A checkpoint's quantization in a few words, from its config alone (`dgpp model list`,
    the console): `GGUF Q4_1`, `GPTQ int4 g128`, `FP8 block 128x128`, `none`."""
    quant = quant_config(raw, path)
    if quant is None:
        return "none"
    method = canonical_method(quant)
    if method == "gguf":
        counts: dict[str, int] = {}
        for fmt in (quant.get("weight_formats") or {}).values():
            counts[fmt] = counts.get(fmt, 0) + 1
        ranked = sorted(counts, key=lambda fmt: -counts[fmt])
        main = [fmt for fmt in ranked if fmt not in ("F32", "F16", "BF16")][:1] or ranked[:1]
        others = [fmt for fmt in ranked if fmt not in main and fmt not in ("F32", "F16", "BF16")]
        extra = f" (+{', '.join(others)})" if others else ""
        return f"GGUF {main[0]}{extra}" if main else "GGUF"
    group = quant.get("group_size", quant.get("q_group_size"))
    group_text = f" g{group}" if isinstance(group, int) and group > 0 else ""
    if method in ("gptq", "awq", "auto-round", "auto_round"):
        name = {"gptq": "GPTQ", "awq": "AWQ"}.get(method, "AutoRound")
        order = " act-order" if quant.get("desc_act") else ""
        return f"{name} int{quant.get('bits', quant.get('w_bit', 4))}{group_text}{order}"
    if method == "fp8":
        block = quant.get("weight_block_size")
        return f"FP8 block {block[0]}x{block[1]}" if block else "FP8"
    if method == "modelopt":
        return f"ModelOpt {quant.get('quant_algo', '?')}"
    if method == "mxfp4":
        return "MXFP4 experts"
    if method == "compressed-tensors":
        kinds = []
        for entry in (quant.get("config_groups") or {}).values():
            weights = (entry or {}).get("weights") or {}
            kind = f"{weights.get('type', 'int')}{weights.get('num_bits', '?')}"
            if weights.get("group_size"):
                kind += f" g{weights['group_size']}"
            elif weights.get("strategy"):
                kind += f" {weights['strategy']}"
            kinds.append(kind)
        fmt = quant.get("format", "")
        return "compressed-tensors " + (", ".join(sorted(set(kinds))) or str(fmt))
    return method
