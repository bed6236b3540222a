"""`kv_cache_dtype` on real engines: each family with paged keys and values or MLA latents
(with DSA's indexer keys) serves every quantized dtype with its log-probabilities within a
bound of the model-dtype cache's at every position (a prompt in chunks smaller than it, then
forced decode rows), its caches stored as quantized rows; families whose caches cannot take it
are refused when the plan is made, with the values that work (the Triton kernels' reads:
tests/kernels/test_kv_quant_triton.py, test_mla_decode_triton.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM
from dgpp.engine.backends import sparse_mla, torch_mla, torch_paged
from dgpp.engine.backends.cache_spec import IndexerKeySpec, MLALatentSpec
from dgpp.engine.backends.state_cache import StateSlotLayer
from dgpp.engine.errors import ConfigError
from dgpp.engine.scheduling.request import PromptIds
from dgpp.kernels import mla_attention_torch
from dgpp.kernels.kv_quant import kv_format
from dgpp.kernels.kv_rotation import rotate, rotation
from tests.conftest import build_tiny_checkpoint
from tests.engine.family_cases import DEEPSEEK_V4, DSA, GPT_OSS, KIMI, MIMO, MOE_DEEPSEEK
from tests.engine.family_parity import forced_logprobs
from tests.engine.parity import check_snapshot_hits

# Against the model-dtype cache, over every position (float32, random tiny models: a MoE's
# routing flips under any perturbation, so the worst position says little): the mean over
# positions of the largest |Δ logprob|, and the share of positions whose top-1 token agrees.
# Measured (mean of the worst |Δ| per position, top-1): int8 0.013-0.055, 95.7-98.9%; fp8
# 0.068-0.18, 91-97%; int4 0.22-0.51, 63-89% (gpt-oss's routing flips most). A wrong scale or
# code is off by order one.
BOUND = {"int8": 0.08, "fp8_e4m3": 0.25, "int4": 0.7}
AGREEMENT = {"int8": 0.93, "fp8_e4m3": 0.88, "int4": 0.55}
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "gpt-oss": ("GptOssForCausalLM", GPT_OSS),  # windows and sinks
    "qwen3-next": ("Qwen3NextForCausalLM", {"mlp_only_layers": [1]}),  # hybrid: states as they are
    "mimo-v2-flash": ("MiMoV2FlashForCausalLM", MIMO),  # keys padded to the values' width
    "deepseek-v3": ("DeepseekV3ForCausalLM", {**MOE_DEEPSEEK, "num_hidden_layers": 3}),  # MLA
    "kimi-linear": ("KimiLinearForCausalLM", KIMI),  # MLA beside KDA states
    "qwen4-exp": ("Qwen4ExpForCausalLM", {}),  # QSA: a block indexer's keys over paged K/V
    "deepseek-v4": ("DeepseekV4ForCausalLM", DEEPSEEK_V4),  # compressed keys (+ an indexer's)
}


WINDOWED = ("mimo-v2-flash", "deepseek-v4")  # a sliding window's keys in a state slot


def _window_layers(llm: LLM) -> list[StateSlotLayer]:
    layers = llm.engine.runner.model.modules()
    return [m for m in layers if isinstance(m, StateSlotLayer) and hasattr(m.spec, "kv_dtype")]


def _engine(checkpoint: Path, kv: str, **knobs: object) -> LLM:
    return LLM(
        str(checkpoint), dtype="float32", kv_capacity=1024, block_size=16, native_decode=False,
        kv_cache_dtype=kv, prefix_cache=False, **knobs,
    )  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_quantized_dtype_stays_near_the_model_dtype_cache(
    family: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    architecture, overrides = FAMILIES[family]
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture, **overrides)
    gen = torch.Generator().manual_seed(65)
    prompt = PromptIds(torch.randint(3, 49000, (80,), generator=gen).tolist())
    forced = torch.randint(3, 49000, (12,), generator=gen).tolist()
    want = forced_logprobs(_engine(checkpoint, "auto"), prompt, forced, chunk=24)
    for kv, bound in BOUND.items():
        llm = _engine(checkpoint, kv)
        pools = [pool for pool in llm.engine.runner.kv_caches if pool.dtype == torch.uint8]
        assert pools, f"{kv}: no quantized pool"
        windows = {layer.spec.kv_dtype for layer in _window_layers(llm)}  # MiMo's, V4's
        assert windows == ({kv} if family in WINDOWED else set()), windows
        got = forced_logprobs(llm, prompt, forced, chunk=24)
        per_position = (got - want).abs().amax(dim=-1)  # the worst token at each position
        error = float(per_position.mean())
        same = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        print(f"{family} {kv}: mean of max |Δ logprob| {error:.4f}, top-1 {same:.1%}")
        assert 0 < error < bound and same >= AGREEMENT[kv], (kv, error, same)


def test_dsa_at_int8_is_the_model_dtype_engine_with_each_stored_row_rounded(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V3.2 (latents and indexer keys): a quantized row perturbs the next layer's
    indexer queries, the budget's cut moves, and the logprobs move by order 0.1 on a tiny random
    model (measured: 0.15-0.22 mean of the worst |Δ| per position at int8) where dense MLA
    moves by 0.01; so the check is exact instead: the int8 engine equals a model-dtype engine
    whose stores round each latent and indexer key through int8, at every position."""
    checkpoint = build_tiny_checkpoint(
        tmp_path, tokenizer_dir, "DeepseekV32ForCausalLM", **{**MOE_DEEPSEEK, **DSA}
    )
    gen = torch.Generator().manual_seed(65)
    prompt = PromptIds(torch.randint(3, 49000, (80,), generator=gen).tolist())
    forced = torch.randint(3, 49000, (12,), generator=gen).tolist()
    got = forced_logprobs(_engine(checkpoint, "int8"), prompt, forced, chunk=24)
    stored = mla_attention_torch.store_latent
    rank = json.loads((checkpoint / "config.json").read_text())["kv_lora_rank"]

    def rounded(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, kv=None) -> None:
        assert kv is None
        width = rows.shape[-1]
        spec = IndexerKeySpec(width, "int8") if width == DSA["index_head_dim"] else None
        fmt = spec.row_format if spec else MLALatentSpec(rank, width - rank, "int8").row_format
        stored(fmt.decode(fmt.encode(rows), rows.dtype), cache, slots)

    for module in (torch_mla, sparse_mla):
        monkeypatch.setattr(module, "store_latent", rounded)
    want = forced_logprobs(_engine(checkpoint, "auto"), prompt, forced, chunk=24)
    assert float((got - want).abs().max()) < 1e-5


def test_a_dtype_a_cache_cannot_take_is_refused_with_what_works(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """int4 packs two codes a byte: a latent of odd width (33) cannot take it; the plan says so
    with the values that work, and never falls back to `auto`."""
    checkpoint = build_tiny_checkpoint(
        tmp_path, tokenizer_dir, "DeepseekV3ForCausalLM",
        **{**MOE_DEEPSEEK, "num_hidden_layers": 2, "kv_lora_rank": 33},
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"kv_cache_dtype=int4: .*even.*auto, int8, fp8_e4m3"):
        _engine(checkpoint, "int4")


@pytest.mark.parametrize("family", WINDOWED)
def test_prefix_hits_restore_quantized_windows(
    family: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Snapshots hold a window's quantized rows as they are: at int8, prefix hits where prompts
    branch and on a conversation's next turn give a cold int8 engine's tokens (V4's rates
    within the 4-token blocks the hits are counted in)."""
    architecture, overrides = FAMILIES[family]
    if family == "deepseek-v4":
        rates = {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}
        overrides = {**overrides, "compress_rates": rates}
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture, **overrides)
    check_snapshot_hits(checkpoint, None, kv_cache_dtype="int8", dtype="float32")


def test_int4_rotates_keys_and_values_before_it_rounds_them(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heads of 64 at int4 (`kernels.kv_rotation`): the engine equals a model-dtype engine
    whose stores round each key and value through int4 in the rotated space (x -> Q4(x R) R),
    at every position; rounding without the rotation gives other logprobs (the rotation is
    really applied)."""
    checkpoint = build_tiny_checkpoint(
        tmp_path, tokenizer_dir, "LlamaForCausalLM", hidden_size=256, head_dim=64
    )
    gen = torch.Generator().manual_seed(65)
    prompt = PromptIds(torch.randint(3, 49000, (80,), generator=gen).tolist())
    forced = torch.randint(3, 49000, (12,), generator=gen).tolist()
    got = forced_logprobs(_engine(checkpoint, "int4"), prompt, forced, chunk=24)
    stored = torch_paged.store_kv

    def through(x: torch.Tensor, rotated: bool) -> torch.Tensor:
        fmt = kv_format("int4", x.shape[-1])
        assert fmt is not None
        r = rotation(x.shape[-1], x.device, x.dtype) if rotated else None
        return rotate(fmt.decode(fmt.encode(rotate(x, r)), x.dtype), r)

    def rounding(rotated: bool) -> Callable[..., None]:
        def store(key: torch.Tensor, value: torch.Tensor, *cache: torch.Tensor, kv=None) -> None:
            assert kv is None
            stored(through(key, rotated), through(value, rotated), *cache)

        return store

    results = {}
    for rotated in (True, False):
        monkeypatch.setattr(torch_paged, "store_kv", rounding(rotated))
        results[rotated] = forced_logprobs(_engine(checkpoint, "auto"), prompt, forced, chunk=24)
    assert float((got - results[True]).abs().max()) < 1e-4
    assert float((got - results[False]).abs().max()) > 1e-2
