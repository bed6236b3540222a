"""Metrics through a scripted engine, for what a real model cannot do on demand: exact request
timings and cache hits, overload, engine failure, tool calls; plus the API key and the loading
phase."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import psutil
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dgpp.engine.async_engine import EngineFailureError, OverloadedError
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import RequestOutput, RequestTimings
from dgpp.engine.scheduling.stats import (
    ClassLatency,
    EngineCounters,
    EngineStats,
    PrefixCacheCounters,
)
from dgpp.engine.server.app import attach_state, create_app
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState
from tests.engine.server.scripted import FakeAdmission, ScriptedEngine

TEXT = "Hello world!"  # the scripted pieces 3, 1, 7, 1: four tokens
TOOL_TEXT = 'Let me look.<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TIMINGS = RequestTimings(arrival=10.0, first_scheduled=10.5, first_token=11.0, finished=13.0)
STATS = EngineStats(
    running=1,
    waiting=2,
    prefilling=1,
    kv_blocks_total=100,
    kv_blocks_in_use=25,
    block_size=16,
    prefix_cache_enabled=True,
    prefix_min_tokens=64,
    counters=EngineCounters(
        num_decode_steps=7,
        num_layer_slices=3,
        tokens_generated=50,
        prompt_tokens_total=200,
        prompt_tokens_computed=120,
        prefix_cache=PrefixCacheCounters(
            queries=3, hits=1, misses=2, hit_tokens=80, ttft_hit_sum_s=0.2, ttft_hit_count=1
        ),
        prompt_classes={
            "short": ClassLatency(queue_sum_s=0.1, ttft_sum_s=0.5, count=2),
            "long": ClassLatency(),
        },
    ),
    kernels={"paged_attention": "ok", "fused_moe": "fallback: error 0.9 above the tolerance 0.02"},
)


class MeteredEngine(ScriptedEngine):
    """The scripted engine with stats, fixed request timings, and refusals on demand: `mode`
    'ok', 'overloaded' (refuses every request), or 'fail' (fails after the first output)."""

    def __init__(self, tokenizer: Any, text: str = TEXT, cached_tokens: int = 0) -> None:
        super().__init__(tokenizer, text)
        self.mode = "ok"
        self.cached_tokens = cached_tokens

    def stats(self) -> EngineStats:
        return STATS

    def admit(self, num_requests: int = 1) -> FakeAdmission:
        if self.mode == "overloaded":
            raise OverloadedError("the server is at its queue limit (0 waiting requests)")
        return FakeAdmission(num_requests)

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        use_prefix_cache: bool = True,
        admission: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        self.admit()
        async for output in super().generate(prompt, params, request_id):
            yield replace(
                output,
                num_cached_tokens=self.cached_tokens,
                timings=TIMINGS,
                prompt_class="short",
            )
            if self.mode == "fail":
                raise EngineFailureError("the engine failed while serving: boom")


def _app(engine: Any, **config: Any) -> Any:
    config = ServerConfig(served_model_names=("m",), stats_log_interval_s=0, **config)
    return create_app(ServerState(engine, config, ("m",)))


def _prometheus(client: TestClient, **headers: str) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
        if s.labels.get("model_name") == "m"
    }


def _service(client: TestClient, **headers: str) -> dict[str, int]:
    return client.get("/v1/metrics", headers=headers).json()["service"]


def test_latency_histograms_follow_the_engine_timings(tokenizer: Any) -> None:
    with TestClient(_app(MeteredEngine(tokenizer, cached_tokens=32))) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        samples = _prometheus(client)
    ttft = "dgpp:time_to_first_token_seconds"
    assert samples[(f"{ttft}_count", (("cache", "hit"),))] == 1
    assert samples[(f"{ttft}_sum", (("cache", "hit"),))] == pytest.approx(1.0)
    assert samples[(f"{ttft}_count", (("cache", "miss"),))] == 0
    assert samples[(f"{ttft}_bucket", (("cache", "hit"), ("le", "0.75")))] == 0
    assert samples[(f"{ttft}_bucket", (("cache", "hit"), ("le", "1.0")))] == 1  # le is inclusive
    assert samples[("dgpp:request_queue_time_seconds_sum", ())] == pytest.approx(0.5)
    assert samples[("dgpp:e2e_request_latency_seconds_sum", ())] == pytest.approx(3.0)
    # four tokens: three gaps of (13 - 11) / 3 seconds
    assert samples[("dgpp:inter_token_latency_seconds_count", ())] == 3
    assert samples[("dgpp:inter_token_latency_seconds_sum", ())] == pytest.approx(2.0)
    assert samples[("dgpp:output_tokens_total", ())] == 4
    # By prompt class: this one was short; the long histograms exist and are empty.
    by_class = "dgpp:time_to_first_token_by_prompt_class_seconds"
    assert samples[(f"{by_class}_count", (("prompt_class", "short"),))] == 1
    assert samples[(f"{by_class}_sum", (("prompt_class", "short"),))] == pytest.approx(1.0)
    assert samples[(f"{by_class}_count", (("prompt_class", "long"),))] == 0
    queue = "dgpp:request_queue_time_by_prompt_class_seconds"
    assert samples[(f"{queue}_sum", (("prompt_class", "short"),))] == pytest.approx(0.5)
    assert samples[(f"{queue}_count", (("prompt_class", "long"),))] == 0


def test_engine_families_come_from_the_stats_snapshot(tokenizer: Any) -> None:
    with TestClient(_app(MeteredEngine(tokenizer))) as client:
        samples = _prometheus(client)
        body = client.get("/v1/metrics").json()
    assert samples[("dgpp:num_requests_running", ())] == 1
    assert samples[("dgpp:num_requests_waiting", ())] == 2
    assert samples[("dgpp:kernel_fallback", (("kernel", "fused_moe"),))] == 1
    assert samples[("dgpp:kernel_fallback", (("kernel", "paged_attention"),))] == 0
    assert body["kernels"] == STATS.kernels
    assert samples[("dgpp:kv_cache_usage_perc", ())] == 0.25
    assert samples[("dgpp:prefix_cache_queries_total", ())] == 200  # tokens
    assert samples[("dgpp:prefix_cache_hits_total", ())] == 80
    assert samples[("dgpp:prompt_tokens_total", ())] == 200
    assert samples[("dgpp:generation_tokens_total", ())] == 50
    assert body["scheduler"] == {
        "running": 1,
        "waiting": 2,
        "prefilling": 1,
        "kv_blocks_total": 100,
        "kv_blocks_in_use": 25,
        "kv_block_size": 16,
        "kv_tokens_total": 1600,  # the pool's token capacity
        "tokens_generated": 50,
        "prompt_tokens_total": 200,
        "prompt_tokens_computed": 120,
        "decode_steps": 7,
        "layer_slice_steps": 3,
    }
    cache = body["prefix_cache"]
    assert (cache["queries"], cache["hits"], cache["misses"]) == (3, 1, 2)  # requests
    assert cache["hit_tokens"] == cache["tokens_saved"] == 80
    assert cache["min_tokens"] == 64 and cache["enabled"] is True
    assert cache["ttft_avg_hit_s"] == pytest.approx(0.2)
    assert cache["ttft_avg_miss_s"] is None
    assert body["prompt_classes"] == {
        "short": {
            "requests": 2,
            "queue_sum_s": pytest.approx(0.1),
            "ttft_sum_s": pytest.approx(0.5),
            "queue_avg_s": pytest.approx(0.05),
            "ttft_avg_s": pytest.approx(0.25),
        },
        "long": {
            "requests": 0,
            "queue_sum_s": 0.0,
            "ttft_sum_s": 0.0,
            "queue_avg_s": None,
            "ttft_avg_s": None,
        },
    }


def test_memory_is_rank_0s_process_and_no_device_on_cpu(tokenizer: Any) -> None:
    with TestClient(_app(MeteredEngine(tokenizer))) as client:
        memory = client.get("/v1/metrics").json()["memory"]
        samples = _prometheus(client)
    # This test process runs the app: its resident memory is what both report, give or take
    # what it allocated between the two reads.
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss < memory["host_rss_bytes"] < 2 * rss
    assert 0.5 * rss < samples[("dgpp:process_resident_memory_bytes", ())] < 2 * rss
    if not torch.cuda.is_initialized():  # a CPU engine: no device reading, no device gauges
        assert memory["device_allocated_bytes"] is None
        assert memory["device_reserved_bytes"] is None
        assert memory["device_total_bytes"] is None
        assert not [name for name, _ in samples if name.startswith("dgpp:device_memory")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_memory_counts_what_this_process_holds_on_cuda() -> None:
    from dgpp.engine.server.metrics.process_memory import read_memory

    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB
    reading = read_memory()
    assert reading.device_allocated_bytes is not None and reading.device_total_bytes is not None
    assert reading.device_allocated_bytes >= block.numel()
    assert reading.device_allocated_bytes <= (reading.device_reserved_bytes or 0)
    assert reading.device_reserved_bytes <= reading.device_total_bytes  # type: ignore[operator]


def test_n_choices_are_one_request_and_n_observations(tokenizer: Any) -> None:
    with TestClient(_app(MeteredEngine(tokenizer))) as client:
        assert client.post("/v1/chat/completions", json={**CHAT, "n": 3}).status_code == 200
        body = {**CHAT, "n": 2, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.read().decode().endswith("data: [DONE]\n\n")
        prompts = {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 4}
        assert client.post("/v1/completions", json=prompts).status_code == 200
        service, samples = _service(client), _prometheus(client)
    assert service["requests_total"] == service["succeeded"] == 3
    assert service["tokens_out"] == 4 * (3 + 2 + 4)
    assert samples[("dgpp:e2e_request_latency_seconds_count", ())] == 9


def test_overload_is_shed_and_engine_failure_is_failed(tokenizer: Any) -> None:
    engine = MeteredEngine(tokenizer)
    with TestClient(_app(engine)) as client:
        engine.mode = "overloaded"
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 503
        stream = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
        assert stream.status_code == 503
        engine.mode = "fail"
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 503
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status_code == 200 and "engine_failure" in r.read().decode()
        messages = {**CHAT, "max_tokens": 8, "stream": True}
        with client.stream("POST", "/v1/messages", json=messages) as r:
            assert r.status_code == 200 and "event: error" in r.read().decode()
        service = _service(client)
        samples = _prometheus(client)
    assert service == {
        "requests_total": 5,
        "succeeded": 0,
        "failed": 3,
        "cancelled": 0,
        "shed": 2,
        "rejected": 0,
        "tokens_out": 0,
        "tool_calls_out": 0,
    }
    assert samples[("dgpp:request_shed_total", ())] == 2
    assert samples[("dgpp:request_failure_total", ())] == 3


def test_tool_calls_are_counted_on_every_route(tokenizer: Any) -> None:
    anthropic_tools = [{"name": "ls", "input_schema": TOOLS[0]["function"]["parameters"]}]
    with TestClient(_app(MeteredEngine(tokenizer, TOOL_TEXT))) as client:
        whole = client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS}).json()
        assert whole["choices"][0]["finish_reason"] == "tool_calls"
        body = {**CHAT, "tools": TOOLS, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert '"tool_calls"' in response.read().decode()
        message = {**CHAT, "max_tokens": 64, "tools": anthropic_tools}
        reply = client.post("/v1/messages", json=message).json()
        assert reply["stop_reason"] == "tool_use"
        with client.stream("POST", "/v1/messages", json={**message, "stream": True}) as response:
            assert '"tool_use"' in response.read().decode()
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # no tools
        service = _service(client)
    assert service["tool_calls_out"] == 4
    assert service["succeeded"] == 5


def test_metrics_is_open_and_v1_metrics_needs_the_key(tokenizer: Any) -> None:
    key = {"authorization": "Bearer sesame"}
    with TestClient(_app(MeteredEngine(tokenizer), api_key="sesame")) as client:
        assert client.get("/v1/metrics").status_code == 401
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 401
        assert client.get("/v1/models").status_code == 401  # not a generation route
        assert client.get("/v1/metrics", headers=key).status_code == 200
        samples = _prometheus(client)  # without the key
        assert _service(client, **key)["rejected"] == 1
    assert samples[("dgpp:request_rejected_total", ())] == 1


def test_while_loading_metrics_has_the_service_counters_only(tokenizer: Any) -> None:
    config = ServerConfig(served_model_names=("m",), stats_log_interval_s=0)
    app = create_app(None, config)
    with TestClient(app) as client:
        starting = client.post("/v1/chat/completions", json=CHAT)
        assert starting.status_code == 503 and starting.json()["error"]["code"] == "starting"
        assert client.get("/v1/metrics").status_code == 503
        samples = _prometheus(client)
        assert ("dgpp:num_requests_running", ()) not in samples
        assert samples[("dgpp:request_failure_total", ())] == 1
        engine = MeteredEngine(tokenizer)
        attach_state(app, ServerState(engine, config, ("m",)))
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        service = _service(client)
    assert (service["requests_total"], service["failed"], service["succeeded"]) == (2, 1, 1)


def test_service_counters_are_per_app(tokenizer: Any) -> None:
    with TestClient(_app(MeteredEngine(tokenizer))) as first:
        assert first.post("/v1/chat/completions", json=CHAT).status_code == 200
    with TestClient(_app(MeteredEngine(tokenizer))) as second:
        assert _service(second)["requests_total"] == 0


class CrashingEngine(MeteredEngine):
    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        use_prefix_cache: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        raise RuntimeError("unexpected")
        yield  # an async generator


def test_unexpected_error_counts_once_as_failed(tokenizer: Any) -> None:
    app = _app(CrashingEngine(tokenizer))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 500
        service = _service(client)
    assert (service["requests_total"], service["failed"]) == (1, 1)
