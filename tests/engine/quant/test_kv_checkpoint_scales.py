"""A checkpoint's own static FP8 KV scales (compressed-tensors `kv_cache_scheme`, ModelOpt
`kv_cache_quant_algo`): at `kv_cache_dtype=fp8_e4m3` every stored key and value row carries
the checkpoint's scale of its layer (read back from the cache's bytes), the log-probabilities
stay within fp8's bound of the model-dtype cache through chunks and decode rows, a resident
image restart keeps them, another dtype keeps its own row scales, the native CPU decode step
gives way, and a malformed scale is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.checkpoint.kv_scales import declares_kv_scales
from dgpp.engine.errors import ModelLoadError
from dgpp.engine.execution import native_decode
from dgpp.engine.layers.attention import PagedAttention
from dgpp.engine.scheduling.request import PromptIds
from tests.conftest import tiny_model
from tests.engine.family_parity import forced_logprobs
from tests.engine.quant import quant_build as qb

SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}
KV_SCHEME = {**SCHEME, "dynamic": False}
FP8_BOUND, FP8_AGREEMENT = 0.25, 0.88  # tests/engine/test_kv_cache_dtype.py's fp8 bounds


def _keys_and_values(model: torch.nn.Module, ids: list[int]) -> dict[int, tuple[float, float]]:
    """Each layer's largest |key| (after its norm; RoPE turns pairs, so at most sqrt(2) more)
    and |value| over a calibration prompt, as a calibrating producer records them."""
    seen: dict[int, tuple[float, float]] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def record(_m: object, _i: object, out: torch.Tensor, i: int = index, a=attn) -> None:
            key = a.k_norm(out.view(*out.shape[:-1], -1, a.head_dim))
            value = seen.get(i, (0.0, 0.0))[1]
            seen[i] = (float(key.abs().max()), value)

        def record_v(_m: object, _i: object, out: torch.Tensor, i: int = index) -> None:
            seen[i] = (seen.get(i, (0.0, 0.0))[0], float(out.abs().max()))

        hooks += [attn.k_proj.register_forward_hook(record)]
        hooks += [attn.v_proj.register_forward_hook(record_v)]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return seen


def _checkpoint(out: Path, tokenizer_dir: Path, naming: str = "ct") -> dict[str, float]:
    """A Qwen3 checkpoint with FP8 weights (compressed-tensors) and calibrated KV scales stored
    under `naming`'s names (`ct`: self_attn.k_scale; `modelopt`: self_attn.k_proj.k_scale)."""
    model = tiny_model("Qwen3ForCausalLM", 0)
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": SCHEME}},
        "kv_cache_scheme": KV_SCHEME,
        "ignore": ["lm_head"],
    }
    reference = qb.write_quantized(model, out, qb.compressed(SCHEME, "float-quantized"), config)
    model.load_state_dict(reference)
    calibration = _keys_and_values(model.eval(), list(range(300, 364)))
    tensors = load_file(str(out / "model.safetensors"))
    scales: dict[str, float] = {}
    for index, (key, value) in calibration.items():
        base = f"model.layers.{index}.self_attn"
        names = (
            (f"{base}.k_scale", f"{base}.v_scale")
            if naming == "ct"
            else (f"{base}.k_proj.k_scale", f"{base}.v_proj.v_scale")
        )
        for name, peak in zip(names, (key * 1.5, value * 1.2), strict=True):
            scales[name] = peak / 448.0
            tensors[name] = torch.tensor(scales[name], dtype=torch.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    return scales


def _engine(path: Path, kv: str, **knobs: object) -> LLM:
    return LLM(
        str(path), dtype="float32", kv_capacity=512, block_size=16, kv_cache_dtype=kv,
        prefix_cache=False, **{"native_decode": False, **knobs},
    )  # fmt: skip


def _layers(llm: LLM) -> list[PagedAttention]:
    modules = llm.engine.runner.model.modules()
    return [m for m in modules if type(m) is PagedAttention]


def _row_scales(llm: LLM, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float16 scales of the first `tokens` stored key and value rows of `layer`."""
    cache = _layers(llm)[layer].cache
    assert cache is not None and cache.dtype == torch.uint8
    rows = cache.view(2, -1, *cache.shape[-2:])[:, :tokens]  # [2, slots, H_kv, width]
    scales = rows[..., :2].contiguous().view(torch.float16).float()
    return scales[0], scales[1]


def test_fp8_stores_every_row_at_the_checkpoint_scales(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = tmp_path / "ckpt"
    scales = _checkpoint(path, tokenizer_dir)
    assert ModelConfig.from_checkpoint(path).kv_scales
    gen = torch.Generator().manual_seed(651)
    prompt = PromptIds(torch.randint(3, 49000, (48,), generator=gen).tolist())
    forced = torch.randint(3, 49000, (8,), generator=gen).tolist()
    want = forced_logprobs(_engine(path, "auto"), prompt, forced, chunk=20)

    llm = _engine(path, "fp8_e4m3")
    assert all(layer.static_kv for layer in _layers(llm))
    got = forced_logprobs(llm, prompt, forced, chunk=20)
    worst = (got - want).abs().amax(dim=-1)
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert 0 < float(worst.mean()) < FP8_BOUND and float(agreement) >= FP8_AGREEMENT
    stored = len(prompt) + len(forced) - 1  # the last forced token is scored, not stored
    for index in range(2):
        keys, values = _row_scales(llm, index, stored)
        base = f"model.layers.{index}.self_attn"
        k16 = torch.tensor(scales[f"{base}.k_scale"]).half().float()
        v16 = torch.tensor(scales[f"{base}.v_scale"]).half().float()
        assert torch.equal(keys, k16.expand_as(keys)), f"layer {index}: keys not at k_scale"
        assert torch.equal(values, v16.expand_as(values)), f"layer {index}: values not at v_scale"

    # The same checkpoint at int8 keeps its own row scales (the static ones are fp8's).
    int8 = _engine(path, "int8")
    assert not any(layer.static_kv for layer in _layers(int8))
    forced_logprobs(int8, prompt, forced, chunk=20)
    keys, _ = _row_scales(int8, 0, stored)
    assert keys.unique().numel() > 1


def test_modelopt_names_a_resident_restart_and_the_native_step(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    path = tmp_path / "ckpt"
    scales = _checkpoint(path, tokenizer_dir, naming="modelopt")
    images = tmp_path / "images"
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = []
    for _ in range(2):  # cold (writes the image), then warm from it
        llm = _engine(path, "fp8_e4m3", resident_cache=True, resident_cache_dir=str(images))
        layer = _layers(llm)[1]
        assert layer.static_kv and layer.kv_scale is not None
        k_scale = scales["model.layers.1.self_attn.k_proj.k_scale"]
        assert float(layer.kv_scale[0]) == pytest.approx(k_scale, rel=1e-6)
        runs.append(list(llm.generate([[5, 77, 901, 33, 1200]], params)[0].outputs[0].token_ids))
        reason = native_decode.why_not(
            llm.engine.runner.model, torch.device("cpu"), torch.float32, 1, 16
        )
        assert reason is not None and "static FP8 KV scales" in reason
    assert runs[0] == runs[1]
    assert len(list(images.glob("*.safetensors"))) == 1


def test_declarations_and_malformed_scales(tmp_path: Path, tokenizer_dir: Path) -> None:
    assert declares_kv_scales({"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"})
    assert declares_kv_scales({"kv_cache_scheme": KV_SCHEME})
    assert not declares_kv_scales({"kv_cache_scheme": {**KV_SCHEME, "num_bits": 4}})
    assert not declares_kv_scales({"quant_method": "fp8", "kv_cache_scheme": None})
    path = tmp_path / "ckpt"
    _checkpoint(path, tokenizer_dir)
    good = load_file(str(path / "model.safetensors"))
    for value, says in (
        (torch.tensor(-0.5), "must be finite and positive"),
        (torch.tensor(float("nan")), "must be finite and positive"),
        (torch.ones(4), "a static KV scale is one number"),
    ):
        save_file(
            {**good, "model.layers.1.self_attn.v_scale": value}, str(path / "model.safetensors")
        )
        with pytest.raises(ModelLoadError, match=says) as err:
            _engine(path, "fp8_e4m3")
        assert "model.layers.1.self_attn.v_scale" in str(err.value)
    # A checkpoint that does not declare them loads its scales nowhere and keeps row scales.
    save_file(good, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]["kv_cache_scheme"]
    (path / "config.json").write_text(json.dumps(config))
    assert not any(layer.kv_scale is not None for layer in _layers(_engine(path, "fp8_e4m3")))
