"""Loads safetensors checkpoints into a model through each parameter's `weight_loader`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dgpp.engine.errors import ModelLoadError


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors weight files")
    return files


def load_weights(model: nn.Module, path: Path) -> None:
    """Copy every checkpoint tensor into `model`; raise if any parameter is left unloaded.

    Names are mapped through the model's `packed_modules_mapping` (q/k/v -> qkv_proj, gate/up ->
    gate_up_proj). With tied embeddings, a stored `lm_head.weight` is the same tensor and skipped.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as err:
            raise ModelLoadError(f"cannot read {file}: {err}") from None
        with handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if tied and name == "lm_head.weight":
                    continue
                if "rotary_emb.inv_freq" in name:
                    continue
                _load_one(params, mapping, name, handle.get_tensor(name), loaded)
    if tied:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint {path} is missing {len(missing)} weights: {shown}")


def _load_one(
    params: dict[str, nn.Parameter],
    mapping: dict[str, tuple[str, str | int]],
    name: str,
    tensor: torch.Tensor,
    loaded: set[str],
) -> None:
    for fragment, (fused, shard_id) in mapping.items():
        if f".{fragment}." in name:
            target = name.replace(f".{fragment}.", f".{fused}.")
            param = _param(params, target, name)
            param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
            loaded.add(target)
            return
    param = _param(params, name, name)
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        if param.shape != tensor.shape:
            raise ModelLoadError(
                f"weight {name} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
    else:
        loader(param, tensor)
    loaded.add(name)


def _param(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
    param = params.get(target)
    if param is None:
        raise ModelLoadError(f"checkpoint tensor {source} has no matching model parameter")
    return param
