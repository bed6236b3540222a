"""Loads checkpoints into a model through each parameter's `weight_loader`: safetensors
files, or the GGUF file of a GGUF view (`quant.gguf_view`). A quantized safetensors module's
tensors (`quant.quant_schemes`) are gathered until all have arrived, converted to one packed
weight (`quant.checkpoint_formats`) and loaded as the module's `weight`: packed into a layer
that keeps that form, dequantized into one that does not."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dgpp.engine.checkpoint.kv_scales import KvScales
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.quant.checkpoint_formats import PackedModule, packed_module
from dgpp.engine.quant.gguf_file import GgufFile, GgufTensor
from dgpp.engine.quant.gguf_view import WEIGHTS_NAME
from dgpp.engine.quant.quant_schemes import IGNORED_SUFFIXES, QuantSchemes
from dgpp.kernels.group_codes import GroupFormat, GroupWeight

Loaded = torch.Tensor | GgufTensor | PackedModule
# A model's own name rule, tried before `packed_modules_mapping`: the parameter a checkpoint
# name loads into and the shard id its loader takes (MoE experts), or None.
TargetRule = Callable[[str], "tuple[str, object] | None"]
# A model's own name for a checkpoint tensor, applied first: the name it loads under, or None
# for a tensor the model does not run (Qwen3.5's vision tower, multi-token-prediction layers).
NameRule = Callable[[str], "str | None"]
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _extra_layer(name: str, num_layers: int) -> bool:
    """Layers past `num_hidden_layers`: the multi-token-prediction layers GLM-4.5 and
    DeepSeek-V3 checkpoints append, which the main model does not run."""
    found = _LAYER_INDEX.match(name)
    return found is not None and int(found.group(1)) >= num_layers


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors weight files")
    return files


def gguf_weights(path: Path) -> Path | None:
    """The GGUF file a checkpoint directory takes its weights from (a GGUF view), if any."""
    weights = path / WEIGHTS_NAME
    return weights if weights.exists() and not any(path.glob("*.safetensors")) else None


def named_tensors(
    path: Path, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor | GgufTensor]]:
    """Every checkpoint tensor by its Hugging Face name; a GGUF tensor comes as its raw blocks,
    for the parameter to take packed or dequantized (`_value_for`). A safetensors tensor
    `wanted` refuses is never read (Qwen4-Exp's n-gram tables: tens of GiB, mapped apart)."""
    gguf = gguf_weights(path)
    if gguf is not None:
        for tensor in GgufFile(gguf).tensors():
            yield tensor.name, tensor
        return
    for file in checkpoint_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as err:
            raise ModelLoadError(f"cannot read {file}: {err}") from None
        with handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if wanted is None or wanted(name):
                    yield name, handle.get_tensor(name)


def load_weights(model: nn.Module, path: Path) -> None:
    """Copy every checkpoint tensor into `model`; raise if any parameter is left unloaded.

    Names are mapped through the model's `packed_modules_mapping` (q/k/v -> qkv_proj, gate/up ->
    gate_up_proj) after the model's own `checkpoint_target` rule, if it has one, and after its
    `checkpoint_name` rule (renames, tensors to skip), if it has one. With tied embeddings, a
    stored `lm_head.weight` is the same tensor and skipped.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    num_layers = int(getattr(config, "num_layers", 0) or 0)
    rule: TargetRule | None = getattr(model, "checkpoint_target", None)
    rename: NameRule | None = getattr(model, "checkpoint_name", None)
    schemes: QuantSchemes = getattr(config, "quant_schemes", None) or QuantSchemes()
    pending: dict[str, dict[str, torch.Tensor]] = {}  # quantized module -> tensors so far
    loaded: set[str] = set()
    wanted = None if rename is None else (lambda name: rename(name) is not None)
    kv_scales = KvScales(model)
    for name, tensor in named_tensors(path, wanted):
        stored = name.rpartition(".")[0]  # the module's name in the checkpoint
        if rename is not None:
            renamed = rename(name)
            if renamed is None:
                continue
            name = renamed
        if tied and name == "lm_head.weight":
            continue
        if "rotary_emb.inv_freq" in name or (num_layers and _extra_layer(name, num_layers)):
            continue
        if kv_scales.take(name, tensor):
            continue
        module, _, suffix = name.rpartition(".")
        # Quantization schemes name modules as the model does, or as the checkpoint stores them
        # (a renamed layer's: the MTP layer's `model.layers.{N}.*`).
        scheme = (schemes.of(module) or schemes.of(stored)) if schemes else None
        if schemes and suffix in IGNORED_SUFFIXES:
            continue
        if scheme is not None and suffix in scheme.suffixes:
            assert isinstance(tensor, torch.Tensor)
            parts = pending.setdefault(module, {})
            parts[suffix] = tensor
            if len(parts) == len(scheme.suffixes):
                value = packed_module(module, scheme, pending.pop(module))
                _load_one(params, mapping, f"{module}.weight", value, loaded, rule)
            continue
        _load_one(params, mapping, name, tensor, loaded, rule)
    for module, parts in pending.items():
        scheme = schemes.of(module)
        assert scheme is not None
        lacking = sorted(set(scheme.suffixes) - set(parts))
        raise ModelLoadError(f"quantized module {module} lacks {', '.join(lacking)}")
    if tied:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint {path} is missing {len(missing)} weights: {shown}")


def _value_for(param: nn.Parameter, tensor: Loaded) -> torch.Tensor | GroupWeight:
    """What `param` takes from a checkpoint tensor: a GGUF tensor's raw rows, or a quantized
    module's packed weight, when the parameter keeps that form, else its values (dequantized)."""
    packed = getattr(param, "weight_format", None)
    if isinstance(tensor, PackedModule):
        return tensor.weight if isinstance(packed, GroupFormat) else tensor.dense()
    if not isinstance(tensor, GgufTensor):
        return tensor
    if packed == tensor.format.name:
        return tensor.rows()
    if packed is not None:
        raise ModelLoadError(
            f"tensor {tensor.gguf_name} is {tensor.format.name}, its layer expects {packed}"
        )
    return tensor.dequantize()


def _load_one(
    params: dict[str, nn.Parameter],
    mapping: dict[str, tuple[str, str | int]],
    name: str,
    tensor: Loaded,
    loaded: set[str],
    rule: TargetRule | None = None,
) -> None:
    own = rule(name) if rule is not None else None
    if own is not None and own[0] in params:  # else the model keeps it under its own name
        target, shard = own
        param = _param(params, target, name)
        value = _value_for(param, tensor)
        loader = param.weight_loader  # type: ignore[attr-defined]
        loader(param, value) if shard is None else loader(param, value, shard)
        _mark_loaded(params, target, value, loaded)
        return
    for fragment, (fused, shard_id) in mapping.items():
        if f".{fragment}." in name:
            target = name.replace(f".{fragment}.", f".{fused}.")
            param = _param(params, target, name)
            value = _value_for(param, tensor)
            param.weight_loader(param, value, shard_id)  # type: ignore[attr-defined]
            _mark_loaded(params, target, value, loaded)
            return
    param = _param(params, name, name)
    tensor = _value_for(param, tensor)
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        if param.shape != tensor.shape:
            raise ModelLoadError(
                f"weight {name} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
    else:
        loader(param, tensor)
    _mark_loaded(params, name, tensor, loaded)


def _mark_loaded(
    params: dict[str, nn.Parameter],
    name: str,
    value: torch.Tensor | GroupWeight,
    loaded: set[str],
) -> None:
    """A packed weight loads its layer's scale, zero, global-scale and order parameters too."""
    loaded.add(name)
    if isinstance(value, GroupWeight):
        loaded.update(f"{name}_{part}" for part in ("scale", "zero", "global_scale", "perm"))


def _param(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
    param = params.get(target)
    if param is None:
        raise ModelLoadError(f"checkpoint tensor {source} has no matching model parameter")
    return param
