"""The start-up self-check on real engines (`DGPP_SELFCHECK=force`: the check runs on CPU,
every Triton kernel through Triton's interpreter, as tests/conftest.py sets it): each family's
kernels at its own shapes pass against their twins, a deliberately wrong or failing kernel falls
back to its twin and is said so in the stats, and `strict_kernels` refuses to start instead.

Serving on CPU never dispatches Triton, so a fallback changes no token here; that dispatch
honours it on CUDA devices is `test_selfcheck_dispatch.py`'s."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.errors import ConfigError
from dgpp.engine.server.metrics.service import ServiceCounters
from dgpp.engine.server.routes.metrics_routes import metrics_body
from dgpp.kernels import dispatch, rms_norm_triton
from tests.conftest import build_tiny_checkpoint
from tests.engine.family_cases import GPT_OSS, MOE_DEEPSEEK, MOE_QWEN

# (architecture, overrides, the kernels its deployment dispatches)
FAMILIES = {
    "llama": (
        "LlamaForCausalLM", {}, {"paged_attention", "rope_store", "rms_norm", "silu_and_mul"},
    ),
    "llama-int8": (  # quantized rows: the kernel reads them, the twin stores them
        "LlamaForCausalLM", {}, {"paged_attention", "rms_norm", "silu_and_mul"},
    ),
    "qwen3-moe": (
        "Qwen3MoeForCausalLM", MOE_QWEN,
        {"paged_attention", "rope_store", "rms_norm", "silu_and_mul", "fused_moe"},
    ),
    "gpt-oss": (  # windows, sinks, biased experts with the clamped SwiGLU
        "GptOssForCausalLM", GPT_OSS,
        {"paged_attention", "rope_store", "rms_norm", "silu_and_mul", "fused_moe"},
    ),
    "deepseek-v3-int8": (  # latent attention, the latents' int8 rows read by the kernel
        "DeepseekV3ForCausalLM", {**MOE_DEEPSEEK, "num_hidden_layers": 2},
        {"mla_decode", "rms_norm", "silu_and_mul", "fused_moe"},
    ),
}  # fmt: skip


@pytest.fixture(autouse=True)
def forced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DGPP_SELFCHECK", "force")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a fresh results cache
    yield
    dispatch.restore_kernels()


def _engine(checkpoint: Path, **knobs: object) -> LLM:
    return LLM(str(checkpoint), dtype="float32", kv_capacity=512, **knobs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_kernels_pass_at_its_own_shapes(
    family: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    architecture, overrides, expected = FAMILIES[family]
    checkpoint = build_tiny_checkpoint(tmp_path / family, tokenizer_dir, architecture, **overrides)
    started = time.perf_counter()
    llm = _engine(checkpoint, kv_cache_dtype="int8" if family.endswith("int8") else "auto")
    stats = llm.engine.stats()
    assert stats.kernels == dict.fromkeys(expected, "ok"), stats.kernels
    assert all(check["error"] < check["tolerance"] for check in stats.kernel_checks)
    labels = " / ".join(check["label"] for check in stats.kernel_checks)
    if family == "gpt-oss":
        assert "window" in labels and "sinks" in labels
    if family == "deepseek-v3-int8":
        assert "int8 latents" in labels
    if family in ("qwen3-moe", "gpt-oss"):  # both rows of the tile table
        assert "3 tokens" in labels and "80 tokens" in labels
    seconds = sum(check["seconds"] for check in stats.kernel_checks)
    assert seconds < time.perf_counter() - started  # the first calls are part of the start
    body = metrics_body(stats, ServiceCounters())
    assert body["kernels"] == stats.kernels and body["kernel_checks"] == stats.kernel_checks


def _wrong_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return 1.5 * x  # an injected error: the kernel's output is off by order one


def _ptxas_failure(*args: object, **kwargs: object) -> torch.Tensor:
    raise RuntimeError("ptxas fatal   : Value 'sm_121a' is not defined for option 'gpu-name'")


@pytest.mark.parametrize(
    ("fake", "reason"), [(_wrong_norm, "above the tolerance"), (_ptxas_failure, "sm_121a")]
)
def test_a_failing_kernel_falls_back_and_strict_refuses(
    fake: object, reason: str, monkeypatch: pytest.MonkeyPatch, default_checkpoint: Path
) -> None:
    monkeypatch.setattr(rms_norm_triton, "rms_norm_triton", fake)
    llm = _engine(default_checkpoint)
    state = llm.engine.stats().kernels["rms_norm"]
    assert state.startswith("fallback: ") and reason in state, state
    assert reason in dispatch.fallbacks()["rms_norm"]
    assert llm.engine.stats().kernels["paged_attention"] == "ok"
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 3  # the rank served, on the twins
    with pytest.raises(ConfigError, match=r"strict_kernels.*rms_norm"):
        _engine(default_checkpoint, strict_kernels=True)


def test_a_restart_reads_the_cached_results(default_checkpoint: Path) -> None:
    first = _engine(default_checkpoint).engine.stats().kernel_checks
    del first
    dispatch.restore_kernels()
    started = time.perf_counter()
    second = _engine(default_checkpoint)
    assert second.engine.runner.selfcheck.results
    assert all(result.cached for result in second.engine.runner.selfcheck.results)
    assert time.perf_counter() - started < 60
