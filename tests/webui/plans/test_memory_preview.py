"""The memory preview: the engine's plan of a deployment against the budget rank 0 will read
(host RAM on CPU; this node's GPU, else a Spark, on CUDA), its verdict, the refusal's numbers
and knob, what each KV-cache dtype gives rank 0, and the cache that computes each plan once."""

from __future__ import annotations

import threading
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest

from dgpp.appliance.deployments.deployment import parse_deployment
from dgpp.appliance.deployments.plan import (
    SPARK_BYTES,
    largest_context,
    model_config_of,
    plan_deployment,
    resolve_deployment,
    spark_memory,
)
from dgpp.engine.planning.memory_plan import GIB, DeviceMemory
from dgpp.webui.plans.cache import PlanCache, plan_key
from dgpp.webui.plans.memory_preview import (
    MemoryPreview,
    budget_memory,
    gpu_memory,
    kv_dtype_table,
    preview_memory,
)

QWEN3_8B = {
    "model": "Qwen/Qwen3-8B",
    "engine": {"device": "cuda", "dtype": "bfloat16", "kv_capacity": 65536, "max_model_len": 32768},
}


@pytest.fixture(autouse=True)
def no_checkpoints(tmp_path, monkeypatch) -> None:
    """Nothing downloaded: models are planned from their shipped facts."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("DGPP_HOME", str(tmp_path / "dgpp"))


def deployment(**engine: object):
    return parse_deployment({**QWEN3_8B, "engine": {**QWEN3_8B["engine"], **engine}})


def test_the_budget_is_the_one_rank_zero_reads() -> None:
    cpu = budget_memory(parse_deployment({"model": "default"}))
    assert not cpu.is_accelerator and cpu.description == "cpu (host RAM)"
    assert budget_memory(deployment(), lambda index: None) == spark_memory()
    h200 = DeviceMemory(141 * GIB, 141 * GIB, "cuda:1 (H200)", is_accelerator=True)
    seen = []
    found = budget_memory(deployment(device="cuda:1"), lambda index: seen.append(index) or h200)
    assert (found, seen) == (h200, [1])


class FakeNvml:
    def __init__(self, total: int | None) -> None:
        self.total = total

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        if self.total is None:
            raise RuntimeError("Not Supported")  # a Spark's unified memory
        return SimpleNamespace(total=self.total, free=1, used=self.total - 1)

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA H200"


def test_a_gpu_is_sized_by_nvml_and_taken_as_free() -> None:
    memory = gpu_memory(0, lambda: FakeNvml(150 * GIB))
    assert memory is not None
    assert (memory.total_bytes, memory.free_bytes, memory.is_accelerator) == (
        150 * GIB,
        150 * GIB,
        True,
    )
    assert memory.description == "cuda:0 (NVIDIA H200, 150.00 GiB, none of it held by others)"
    assert gpu_memory(0, lambda: FakeNvml(None)) is None


def test_a_deployment_that_fits_has_every_ranks_numbers() -> None:
    plan = preview_memory(deployment(), spark_memory())
    assert plan.verdict == "fits" and plan.fits and plan.message == ""
    assert (plan.source, plan.quantization) == ("facts", "none")
    (rank,) = plan.ranks
    assert rank.weights_bytes == plan.weights_bytes and rank.text("weights_bytes") == "15.26 GiB"
    assert rank.kv_tokens == 65536 and rank.kv_bytes == 65536 * rank.kv_bytes_per_token
    assert rank.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2  # layers x K,V x kv heads x dim x bf16
    assert rank.total_bytes <= rank.budget_bytes == int(SPARK_BYTES * 0.9) - 4 * 10**9
    assert plan.largest_context == rank.largest_context == 40960  # the model's own limit
    assert plan.summary().startswith("fits on DGX Spark (128 GB unified): 65,536 KV tokens")
    world2 = preview_memory(parse_deployment({**QWEN3_8B, "world_size": 2}), spark_memory())
    assert [rank.rank for rank in world2.ranks] == [0, 1]
    assert world2.weights_bytes < plan.weights_bytes


def test_each_kv_dtype_row_reuses_the_plans_own_search_for_the_configured_one() -> None:
    target, spark = deployment(device="cpu", kv_cache_dtype="int8"), spark_memory()
    model = model_config_of(target)[0]
    resolved = resolve_deployment(target, model, spark)
    (rank0,) = plan_deployment(resolved, spark)
    rows = kv_dtype_table(resolved, spark, replace(rank0, largest_context=12345))
    assert [row.kv_dtype for row in rows] == ["auto", "fp8_e4m3", "int8", "int4"]
    auto, fp8, int8, int4 = rows
    assert int8.largest_context == 12345  # the plan's, not searched again
    weights = rank0.plan.weights_bytes
    searched = largest_context(
        replace(resolved.engine, kv_cache_dtype="auto"), model, 1, 0, spark, weights
    )
    assert auto.largest_context == searched == 40960  # the model's own limit
    assert int8.bytes_per_token == rank0.kv_bytes_per_token and auto.bytes_per_token == 147456
    assert auto.tokens_per_gib == 2**30 // 147456
    assert int8.tokens_per_gib >= 1.8 * auto.tokens_per_gib  # the scales cost a little
    assert int4.tokens_per_gib > fp8.tokens_per_gib > auto.tokens_per_gib
    assert int4.sessions > int8.sessions > auto.sessions > 0
    assert not any(row.refused for row in rows)


def test_the_preview_carries_the_kv_dtype_rows_on_either_device() -> None:
    cpu = preview_memory(deployment(device="cpu", kv_cache_dtype="int4"), spark_memory())
    assert (cpu.kv_dtype, cpu.kv_context, len(cpu.kv_dtypes)) == ("int4", 32768, 4)
    assert MemoryPreview.from_dict(asdict(cpu)) == cpu  # as `plans.store` reads it back
    assert cpu.as_json()["kv_dtypes"][3]["kv_dtype"] == "int4"
    cuda = preview_memory(deployment(), spark_memory())  # the Triton kernels read every dtype
    assert cuda.kv_dtype == "auto" and cuda.kv_dtypes[0].tokens_per_gib == 7281
    assert not any(row.refused for row in cuda.kv_dtypes)
    assert all(row.tokens_per_gib > 1.8 * 7281 for row in cuda.kv_dtypes[1:])


def test_a_kv_pool_too_large_is_refused_on_kv_capacity() -> None:
    plan = preview_memory(deployment(kv_capacity=10**11), spark_memory())
    assert plan.verdict == "refused" and not plan.fits
    assert plan.field == "engine.kv_capacity"
    assert plan.message.startswith(
        "does not fit on DGX Spark (128 GB unified) (world 1): rank 0: weights 15.26 GiB + KV "
    )
    assert "(100,000,000,000 tokens)" in plan.message
    room = plan.ranks[0].budget_bytes - (plan.ranks[0].total_bytes - plan.ranks[0].kv_bytes)
    most = room // plan.ranks[0].kv_bytes_per_token
    assert f"at most about {most:,} KV tokens would fit" in plan.message
    assert plan.summary() == plan.message


def test_weights_too_large_for_the_world_belong_to_no_knob() -> None:
    big = parse_deployment({**QWEN3_8B, "model": "Qwen/Qwen2.5-72B-Instruct"})
    plan = preview_memory(big, spark_memory())
    assert plan.verdict == "refused" and plan.field == ""
    assert "not even the weights, workspace and states fit without any KV pool" in plan.message


def test_a_workspace_too_large_is_refused_on_the_prefill_chunk() -> None:
    plan = preview_memory(deployment(prefill_chunk_tokens=32768), spark_memory())
    assert plan.verdict == "refused", plan.summary()
    assert plan.field == "engine.prefill_chunk_tokens"
    assert plan.ranks[0].workspace_bytes > plan.ranks[0].weights_bytes


def test_the_engines_own_refusals_name_their_knob() -> None:
    plan = preview_memory(deployment(memory_fraction=0.1), spark_memory())
    assert plan.verdict == "refused" and plan.ranks == ()
    assert plan.message.startswith("memory_fraction=0.1 leaves ")
    assert plan.field == "engine.memory_fraction"  # not on the form: shown above it
    plan = preview_memory(deployment(kv_capacity=4096), spark_memory())
    assert plan.message.startswith("max_model_len=32768 exceeds what this model and KV pool")
    assert plan.field == "engine.max_model_len"

    # The preview resolves as rank 0 does: a quantization the weights are not stored in is
    # refused here, on its knob, not after the switch has restarted rank 0.
    plan = preview_memory(deployment(quantization="gptq"), spark_memory())
    assert plan.verdict == "refused" and plan.ranks == ()
    assert "asks for quantization 'gptq', but the checkpoint's weights" in plan.message
    assert plan.field == "engine.quantization"


def test_without_the_checkpoint_or_its_facts_there_is_no_plan() -> None:
    plan = preview_memory(parse_deployment({"model": "org/unknown"}), spark_memory())
    assert plan.verdict == "unknown" and plan.ranks == ()
    assert plan.message.startswith(
        "no memory plan: the checkpoint is not on this machine and no facts about it ship with "
        "dgpp (model org/unknown is not downloaded"
    )
    assert "the switch is allowed" in plan.message


def test_a_plan_key_follows_what_the_plan_reads() -> None:
    spark = spark_memory()
    assert plan_key(deployment(), spark) == plan_key(deployment(), spark)
    assert plan_key(deployment(), spark) != plan_key(deployment(kv_capacity=4096), spark)
    assert plan_key(deployment(), spark) != plan_key(deployment(), spark_memory(256 * 10**9))
    host = DeviceMemory(64 * GIB, 10 * GIB + 5, "cpu (host RAM)", is_accelerator=False)
    moved = DeviceMemory(64 * GIB, 10 * GIB + (7 << 20), "cpu (host RAM)", is_accelerator=False)
    assert plan_key(deployment(), host) == plan_key(deployment(), moved)  # to the GiB


def test_the_cache_computes_each_plan_once_and_in_the_background() -> None:
    calls: list[int] = []
    release = threading.Event()

    def plan(target, memory) -> MemoryPreview:
        calls.append(target.engine.kv_capacity)
        release.wait(5)
        return MemoryPreview("fits", "", model=target.model)

    cache = PlanCache(plan, gpu=lambda index: None)
    first = deployment()
    assert cache.known(first, schedule=True) is None  # queued for the background
    waiter = threading.Thread(target=cache.plan, args=(first,))  # shares the running one
    waiter.start()
    release.set()
    waiter.join(5)
    assert cache.known(first) == cache.plan(first) == MemoryPreview("fits", "", model=first.model)
    assert calls == [65536]
    cache.close()
    assert cache.known(deployment(kv_capacity=4096), schedule=True) is None  # closed: not queued
    assert calls == [65536]


def test_side_models_are_in_the_preview_and_one_that_does_not_fit_refuses_it() -> None:
    """The preview shows each node with its side models, as `dgpp deploy plan` counts them; a
    side model the node cannot hold refuses the switch on `side_models`; the rows survive the
    plan store's round trip."""
    gpu = {"device": "cuda", "dtype": "bfloat16"}
    small = [{"name": "emb", "model": "x", "kind": "embed", "memory_gib": 2, "load": "always"}]
    fits = preview_memory(parse_deployment({**QWEN3_8B, "side_models": small}), spark_memory())
    assert fits.verdict == "fits"
    (node,) = fits.sides
    assert node.always == "emb 2.00 GiB" and node.on_demand == "-" and node.problems == ""
    assert MemoryPreview.from_dict(asdict(fits)) == fits
    big = [{"name": "big", "model": "Qwen/Qwen2.5-72B-Instruct", "engine": gpu}]
    refused = preview_memory(parse_deployment({**QWEN3_8B, "side_models": big}), spark_memory())
    assert refused.verdict == "refused" and refused.field == "side_models"
    assert refused.message.startswith("the side models do not fit: node 0: the main model")
    assert "big (largest on demand)" in refused.sides[0].problems
    assert preview_memory(deployment(), spark_memory()).sides == ()
