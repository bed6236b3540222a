"""The per-rank memory plan: exact weight and KV bytes, the fit check, KV sizing and mlock."""

from __future__ import annotations

import argparse
import ctypes
import errno
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from dgpp.appliance.commands.engine_options import add_engine_options, engine_knobs
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.engine import LLMEngine
from dgpp.engine.errors import ConfigError
from dgpp.engine.models.registry import build_model
from dgpp.engine.planning import memory_plan
from dgpp.engine.planning.device_memory import read_host_memory
from dgpp.engine.planning.memory_lock import lock_memory
from dgpp.engine.planning.memory_plan import (
    DeviceMemory,
    MemoryPlan,
    RankShapes,
    check_fits,
    kv_bytes_per_token,
    plan_memory,
    rank_cache_specs,
    size_kv_pool,
    workspace_bytes,
)
from dgpp.engine.planning.resolved import resolve
from tests.conftest import build_tiny_checkpoint

GIB = 1 << 30
RAW = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1001,  # odd: tp 2 pads the vocabulary
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
PLENTY = DeviceMemory(64 * GIB, 48 * GIB, "test host", is_accelerator=False)


def _model(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict({**RAW, **overrides})


def _config(**knobs: Any) -> EngineConfig:
    return EngineConfig(model="tiny", **{"kv_capacity": 256, "block_size": 16, **knobs})


def _parameter_bytes(
    model: ModelConfig, dtype: torch.dtype, tp_size: int = 1, tp_rank: int = 0
) -> int:
    parallel = ParallelContext(tp_rank=tp_rank, tp_size=tp_size)
    built = build_model(model, parallel, 64, TorchPagedAttention(torch.device("cpu"))).to(dtype)
    return sum(p.numel() * p.element_size() for p in built.parameters())  # tied counted once


VARIANTS = [
    pytest.param({"tie_word_embeddings": True}, id="llama-tied"),
    pytest.param({"tie_word_embeddings": False, "mlp_bias": True}, id="llama-untied-mlp-bias"),
    pytest.param({"architectures": ["Qwen2ForCausalLM"]}, id="qwen2-qkv-bias"),
    pytest.param({"architectures": ["Qwen3ForCausalLM"], "head_dim": 32}, id="qwen3-qk-norm"),
    pytest.param(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
        },
        id="qwen3-moe",
    ),
    pytest.param(
        {
            "architectures": ["Glm4MoeForCausalLM"],
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "partial_rotary_factor": 0.5,
        },
        id="glm4-moe",
    ),
]


@pytest.mark.parametrize("overrides", VARIANTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_bytes_equal_the_built_models_parameters(
    overrides: dict[str, Any], dtype: str
) -> None:
    model = _model(**overrides)
    plan = plan_memory(_config(dtype=dtype), model, 1, PLENTY)
    assert plan.weights_bytes == _parameter_bytes(model, getattr(torch, dtype))


@pytest.mark.parametrize("overrides", VARIANTS)
@pytest.mark.parametrize(
    "heads",
    [(4, 2), (4, 1), (6, 3)],  # even split; one kv head replicated; 3 groups dealt 2 + 1
    ids=["even", "replicated-kv", "uneven"],
)
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tp2_weight_bytes_equal_each_ranks_shards(
    overrides: dict[str, Any], heads: tuple[int, int], tp_rank: int
) -> None:
    num_heads, num_kv_heads = heads
    model = _model(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, **overrides)
    plan = plan_memory(_config(), model, 2, PLENTY, tp_rank=tp_rank)
    assert plan.weights_bytes == _parameter_bytes(model, torch.float32, 2, tp_rank)


def test_uneven_heads_give_rank_0_the_larger_kv_pool() -> None:
    model = _model(num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    rank0, rank1 = (plan_memory(_config(), model, 2, PLENTY, tp_rank=r) for r in (0, 1))
    assert rank0.kv_bytes == 2 * rank1.kv_bytes  # two kv groups against one


def test_tp2_halves_the_sharded_parts() -> None:
    model = _model(vocab_size=1000, tie_word_embeddings=False)
    one, two = (plan_memory(_config(), model, tp, PLENTY) for tp in (1, 2))
    norms = (2 * model.num_layers + 1) * model.hidden_size * 4  # replicated
    assert two.weights_bytes - norms == (one.weights_bytes - norms) // 2
    assert two.kv_bytes * 2 == one.kv_bytes
    replicated_kv = _model(num_key_value_heads=1)
    assert plan_memory(_config(), replicated_kv, 2, PLENTY).kv_bytes == (
        plan_memory(_config(), replicated_kv, 1, PLENTY).kv_bytes
    )


def test_unshardable_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot shard this model over 3 ranks"):
        plan_memory(_config(), _model(), 3, PLENTY)
    with pytest.raises(ConfigError, match="intermediate_size=97 is not divisible by tp_size=2"):
        plan_memory(_config(), _model(intermediate_size=97), 2, PLENTY)


def test_kv_and_weight_bytes_match_a_running_engine(tmp_path: Path, tokenizer_dir: Path) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "Qwen2ForCausalLM")
    config = EngineConfig(model=str(checkpoint), kv_capacity=200, block_size=16)
    engine = LLMEngine(resolve(config, checkpoint))
    plan = plan_memory(engine.config, engine.model_config, 1, PLENTY)
    assert plan.kv_bytes == sum(pool.nbytes for pool in engine.runner.kv_caches)
    assert plan.kv_tokens == 208  # whole blocks
    assert plan.weights_bytes == _parameter_bytes(engine.model_config, torch.float32)


def test_workspace_grows_with_the_step_and_the_context() -> None:
    model = _model()
    shapes = RankShapes.of(model, 1)
    base = workspace_bytes(_config(), model, shapes, 256)
    assert workspace_bytes(_config(prefill_chunk_tokens=1024), model, shapes, 256) > base
    assert workspace_bytes(_config(max_concurrency=256), model, shapes, 256) > base
    assert workspace_bytes(_config(), model, shapes, 4096) > base
    # fp32 logits from a bf16 model cast the LM head: one fp32 copy of this rank's table
    bf16 = _config(dtype="bfloat16", prefill_chunk_tokens=1)  # logits dominate the peak
    cast = workspace_bytes(bf16, model, shapes, 16) - workspace_bytes(
        replace(bf16, prefill_precision="model"), model, shapes, 16
    )
    assert cast == pytest.approx(model.vocab_size * model.hidden_size * 4 * 1.25, abs=1)


def test_cuda_plans_count_the_decode_graphs_scratch_block_and_pool() -> None:
    model, shapes = _model(), RankShapes.of(_model(), 1)
    specs = rank_cache_specs(model, 1, 0)
    cuda = _config(device="cuda", dtype="bfloat16")
    graphs = memory_plan.decode_graph_bytes(cuda, model, shapes, specs, 256)
    block = 16 * kv_bytes_per_token(cuda, specs)  # the scratch block past the pool
    assert graphs > block + (4 * 64 + 64 * 16) * 8  # and the static inputs and tables
    off = memory_plan.decode_graph_bytes(
        replace(cuda, cuda_graph_max_batch=0), model, shapes, specs, 256
    )
    assert off == 0 == memory_plan.decode_graph_bytes(_config(), model, shapes, specs, 256)
    fewer = memory_plan.decode_graph_bytes(
        replace(cuda, max_concurrency=8), model, shapes, specs, 256
    )
    assert block < fewer < graphs  # the largest bucket is the smaller of the two knobs
    with_graphs, without = (
        plan_memory(replace(cuda, cuda_graph_max_batch=n), model, 1, PLENTY) for n in (64, 0)
    )
    assert with_graphs.buffers_bytes - without.buffers_bytes == graphs
    # A hybrid model's padded rows also take a scratch recurrent-state slot.
    hybrid = memory_plan.decode_graph_bytes(cuda, model, shapes, specs, 256, state_slot_bytes=999)
    assert hybrid == graphs + 999


def test_plan_that_does_not_fit_names_every_part_and_the_remedies() -> None:
    small = DeviceMemory(8 << 20, 4 << 20, "tiny box", is_accelerator=False)
    plan = plan_memory(_config(kv_capacity=100_000), _model(), 1, small)
    assert plan.total_bytes == (
        plan.weights_bytes + plan.kv_bytes + plan.buffers_bytes + plan.workspace_bytes
    )
    assert plan.budget_bytes == 4 << 20 and not plan.fits
    with pytest.raises(ConfigError) as raised:
        check_fits(plan)
    message = str(raised.value)
    for part in ("weights", "KV pool", "workspace", "budget", "tiny box"):
        assert part in message
    for remedy in ("kv_capacity", "max_concurrency", "prefill_chunk_tokens", "memory_fraction"):
        assert remedy in message
    assert "more ranks" in message
    check_fits(plan_memory(_config(), _model(), 1, PLENTY))  # fits: no error


def test_describe_is_one_line_in_gib_and_mib() -> None:
    plan = MemoryPlan(3 * GIB, 512 << 20, 4096, 1 << 20, 64 << 20, 0, 8 * GIB, 10 * GIB, "gpu0")
    text = plan.describe()
    assert "\n" not in text
    assert "weights 3.00 GiB" in text and "KV pool 512.0 MiB (4096 tokens)" in text
    assert "8.00 GiB budget" in text and "gpu0" in text


def test_budget_rules_for_cuda_and_host() -> None:
    gpu = DeviceMemory(100 * GIB, 90 * GIB, "gpu", is_accelerator=True)
    assert gpu.budget(None) == 80 * GIB  # 0.9 of total, minus the 10 GiB others hold
    assert gpu.budget(0.5) == 40 * GIB
    assert gpu.budget(0.05) == 0
    host = DeviceMemory(64 * GIB, 20 * GIB, "host", is_accelerator=False)
    assert host.budget(None) == 20 * GIB
    assert host.budget(0.25) == 16 * GIB
    assert host.budget(0.5) == 20 * GIB  # never more than is available


def test_host_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       16384000 kB\nMemFree:         1000000 kB\nMemAvailable:    8192000 kB\n"
        "HugePages_Total:       0\n"
    )
    memory = read_host_memory(meminfo)
    assert (memory.total_bytes, memory.free_bytes) == (16384000 * 1024, 8192000 * 1024)
    assert not memory.is_accelerator


def test_memory_fraction_sizes_the_pool_deterministically() -> None:
    model = _model()
    config = _config(memory_fraction=0.5, max_concurrency=256, prefill_chunk_tokens=64)
    memory = DeviceMemory(64 << 20, 60 << 20, "test host", is_accelerator=False)
    sized = size_kv_pool(config, model, 1, memory)
    assert sized == size_kv_pool(config, model, 1, memory)
    assert sized.kv_capacity % config.block_size == 0
    assert model.max_position_embeddings <= sized.kv_capacity < 256 * 256  # budget-bound
    plan = plan_memory(sized, model, 1, memory)
    assert plan.budget_bytes == 32 << 20  # half of the total; less than is available
    check_fits(plan)
    per_block = kv_bytes_per_token(config, rank_cache_specs(model, 1, 0)) * config.block_size
    # Filled to the block, short of the 2% slack that keeps a later re-check fitting.
    assert plan.total_bytes <= plan.budget_bytes * 0.98 < plan.total_bytes + per_block
    assert size_kv_pool(_config(), model, 1, memory) == _config()  # no fraction: unchanged


def test_sized_pool_is_capped_at_max_concurrency_full_contexts() -> None:
    model = _model()
    sized = size_kv_pool(_config(memory_fraction=1.0, max_concurrency=3), model, 1, PLENTY)
    assert sized.kv_capacity == 3 * model.max_position_embeddings


def test_memory_fraction_refuses_when_one_request_cannot_fit() -> None:
    memory = DeviceMemory(64 << 20, 60 << 20, "test host", is_accelerator=False)
    long_context = _model(max_position_embeddings=1 << 20)
    with pytest.raises(ConfigError, match="one request of 1048576 tokens") as raised:
        size_kv_pool(_config(memory_fraction=0.5), long_context, 1, memory)
    assert "max_model_len" in str(raised.value)
    sized = size_kv_pool(_config(memory_fraction=0.5, max_model_len=1024), long_context, 1, memory)
    assert sized.kv_capacity >= 1024


def test_engine_with_an_impossible_pool_fails_before_building_the_model(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built although the plan cannot fit")

    # The plan counts weights on a model built on the meta device; the runner's own build, the
    # one that allocates, must not happen.
    monkeypatch.setattr("dgpp.engine.execution.model_loading.build_model", never)
    # 10**12 tokens are terabytes of KV for any model: no machine running this test has them.
    config = EngineConfig(model=str(checkpoint), kv_capacity=10**12, max_model_len=512)
    with pytest.raises(ConfigError, match="does not fit"):
        LLMEngine(resolve(config, checkpoint))


def test_engine_sizes_its_pool_from_memory_fraction(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    memory = DeviceMemory(240 << 20, 230 << 20, "test host", is_accelerator=False)
    monkeypatch.setattr(memory_plan, "read_device_memory", lambda device, floor=0: memory)
    config = EngineConfig(
        model=str(checkpoint), memory_fraction=0.5, max_concurrency=4, prefill_chunk_tokens=64
    )
    engine = LLMEngine(resolve(config, checkpoint))
    expected = size_kv_pool(config, engine.model_config, 1, memory).kv_capacity
    assert expected != config.kv_capacity
    assert engine.config.kv_capacity == expected
    assert engine.runner.kv_caches[0].shape[2] * engine.config.block_size == expected


def test_cli_flags_reach_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    knobs = engine_knobs(parser.parse_args(["--memory-fraction", "0.6", "--mlock"]))
    config = EngineConfig(model="tiny", **knobs)
    assert config.memory_fraction == 0.6 and config.mlock
    unset = EngineConfig(model="tiny", **engine_knobs(parser.parse_args([])))
    assert unset.memory_fraction is None and not unset.mlock


class FakeLibc:
    def __init__(self, result: int, code: int = 0) -> None:
        self.result, self.code = result, code
        self.flags: list[int] = []

    def mlockall(self, flags: int) -> int:
        self.flags.append(flags)
        ctypes.set_errno(self.code)
        return self.result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_lock_memory_locks_current_and_future_pages() -> None:
    libc = FakeLibc(0)
    lock_memory(libc)
    assert libc.flags in ([1 | 2], [0x2000 | 0x4000])  # MCL_CURRENT | MCL_FUTURE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
@pytest.mark.parametrize("code", [errno.EPERM, errno.ENOMEM])
def test_lock_memory_failure_explains_the_memlock_limit(code: int) -> None:
    with pytest.raises(ConfigError) as raised:
        lock_memory(FakeLibc(-1, code))
    message = str(raised.value)
    assert "LimitMEMLOCK=infinity" in message and "ulimit -l" in message
