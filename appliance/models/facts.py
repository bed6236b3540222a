"""The architecture facts of the checkpoints the shipped templates serve, transcribed from each
repository's `config.json` (`appliance/checkpoint_facts/<org>--<name>.json`), so a deployment's
memory plan can be drawn before hundreds of gigabytes are downloaded.

A quantized checkpoint's layout normally comes from its safetensors headers
(`quant.quant_schemes`); without the files, `UniformSchemes` stands for what these checkpoints
hold: every linear of the decoder layers quantized the one way the config names, except the
routers (`mlp.gate` / `mlp.router`, kept in bfloat16 by every producer), the modules the config
lists by name as left unquantized (`modules_to_not_convert`; `ignored_layers`: MiMo-V2-Flash's
`o_proj`s; plain `ignore` entries: Qwen3-Next's `linear_attn.in_proj_ba`), the embeddings and
the LM head. gpt-oss's MXFP4 is read by the model itself (`quant_method: mxfp4`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.quant.methods import GROUP_METHODS
from dgpp.engine.quant.quant_schemes import (
    LayerScheme,
    QuantSchemes,
    canonical_method,
    quant_config,
)
from dgpp.kernels.group_codes import GroupFormat

FACTS_DIR = Path(__file__).parents[1] / "checkpoint_facts"
_ROUTERS = (".mlp.gate", ".mlp.router")


@dataclass(frozen=True)
class UniformSchemes(QuantSchemes):
    """One `LayerScheme` for every decoder-layer linear but the routers and `unquantized`
    (the MTP layer's decoder block too: `model.layers.{N}` or `mtp.layers.0`, quantized like
    the others in the FP8 releases)."""

    scheme: LayerScheme | None = None
    unquantized: frozenset[str] = frozenset()  # module names the config keeps dense

    def __bool__(self) -> bool:
        return self.scheme is not None

    def of(self, module: str) -> LayerScheme | None:
        covered = module.startswith(("model.layers.", "mtp.layers.")) and not module.endswith(
            _ROUTERS
        )
        return self.scheme if covered and module not in self.unquantized else None

    def group_format(
        self, modules: Sequence[str], cols: int, in_start: int = 0, in_total: int = 0
    ) -> GroupFormat | None:
        if self.scheme is None or any(self.of(name) is None for name in modules):
            return None
        fmt = self.scheme.group_format(cols)
        split = in_total not in (0, cols)
        if split and (in_start % fmt.group_size or cols % fmt.group_size):
            return None
        return fmt

    def describe(self) -> str:
        return f"{self.method}: {self.scheme.describe()} (from the config)" if self.scheme else ""


def config_scheme(method: str, quant: dict[str, object]) -> LayerScheme | None:
    """The layer scheme a method's config implies, for the methods the templates use."""
    if method == "fp8":
        block = quant.get("weight_block_size")
        if isinstance(block, list):
            rows, cols = int(block[0]), int(block[1])
            suffixes = ("weight", "weight_scale_inv")
            return LayerScheme("fp8", "e4m3", cols, "float32", suffixes, block=(rows, cols))
        return LayerScheme("fp8", "e4m3", 0, "float32", ("weight", "weight_scale"))
    if method == "compressed-tensors" and quant.get("format") == "float-quantized":
        return LayerScheme("fp8", "e4m3", 0, "float32", ("weight", "weight_scale"))
    return None


def facts_path(repo: str) -> Path:
    return FACTS_DIR / (repo.replace("/", "--") + ".json")


def has_facts(repo: str) -> bool:
    return facts_path(repo).is_file()


def facts_config(repo: str) -> ModelConfig:
    """`repo`'s ModelConfig from its shipped facts (`FileNotFoundError` if none ship)."""
    raw = json.loads(facts_path(repo).read_text())
    config = ModelConfig.from_dict(raw)
    quant = quant_config(raw)
    if quant is None:
        return config
    method = canonical_method(quant)
    if method not in GROUP_METHODS:
        return config
    scheme = config_scheme(method, quant)
    if scheme is None:
        raise ValueError(f"{facts_path(repo)}: no uniform scheme for {method!r}")
    schemes = UniformSchemes(method, (), scheme, unquantized_modules(quant))
    return replace(config, quant_schemes=schemes)


def unquantized_modules(quant: dict[str, object]) -> frozenset[str]:
    """The modules a quantization config names as left dense (patterns, `re:...`, are not
    names: the routers they match are excepted anyway)."""
    names: set[str] = set()
    for key in ("modules_to_not_convert", "ignore", "ignored_layers"):
        entries = quant.get(key)
        if isinstance(entries, list):
            names.update(str(e) for e in entries if not str(e).startswith("re:"))
    return frozenset(names)
