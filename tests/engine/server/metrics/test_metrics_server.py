"""Metrics on a real server (the default model): service counters move by exact amounts,
/metrics parses and has every documented name, /v1/metrics every documented key, and the stats
log line appears."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.server.conftest import DEFAULT_ENGINE
from tests.engine.server.harness import RunningServer, assert_error, running_server

DOCS = Path(__file__).resolve().parents[4] / "docs" / "metrics.md"
SESSION_KEYS = {"idle_s", "expired", "hit_tokens", "hit_rate", "prompt_tokens"}
PRIORITY_KEYS = {"waiting", "running", "requests", "queue_avg_s", "ttft_avg_s", "itl_avg_s"}
JSON_KEYS = {
    # The start-up self-check and the world's all-reduce: empty on a CPU world of one (the
    # self-check runs where Triton kernels serve; tests/engine/selfcheck fills them).
    "kernels": set(),
    "kernel_checks": set(),
    "allreduce": set(),
    "scheduler": {
        "running",
        "waiting",
        "prefilling",
        "kv_blocks_total",
        "kv_blocks_in_use",
        "kv_block_size",
        "kv_tokens_total",
        "tokens_generated",
        "prompt_tokens_total",
        "prompt_tokens_computed",
        "decode_steps",
        "layer_slice_steps",
    },
    "service": {
        "requests_total",
        "succeeded",
        "failed",
        "cancelled",
        "shed",
        "rejected",
        "tokens_out",
        "tool_calls_out",
    },
    "memory": {
        "host_rss_bytes",
        "device_allocated_bytes",
        "device_reserved_bytes",
        "device_total_bytes",
    },
    "prefix_cache": {
        "enabled",
        "queries",
        "hits",
        "misses",
        "hit_tokens",
        "tokens_saved",
        "evictions",
        "skipped_inserts",
        "host_hit_tokens",
        "host_spilled_blocks",
        "host_loaded_blocks",
        "host_evicted_blocks",
        "disk_hit_tokens",
        "disk_blocks",
        "disk_saved_blocks",
        "disk_unsaved_blocks",
        "disk_fetched_blocks",
        "disk_failed_blocks",
        "disk_dropped_blocks",
        "disk_read_bytes",
        "disk_read_seconds",
        "min_tokens",
        "ttft_avg_hit_s",
        "ttft_avg_miss_s",
        "state_snapshots",
    },
    "step_model": {
        "decode_step_s",
        "token_s",
        "token_position_s",
        "chunk_position_s",
        "chunk_s",
        "short_prompt_tokens",
        "solo_short_s",
    },
    "prompt_classes": {"short", "long"},
    "spec_decode": {
        "method",
        "depth",
        "drafts",
        "drafted",
        "accepted",
        "acceptance_rate",
        "mean_accepted_length",
        "drafts_per_step",
        "per_position",
    },
    "vision": {
        "requests",
        "images",
        "tokens",
        "images_per_request",
        "encoded",
        "encoder_seconds",
        "encoder_avg_s",
        "encoder_cache_hits",
    },
}
HISTOGRAMS = (
    "dgpp:e2e_request_latency_seconds",
    "dgpp:request_queue_time_seconds",
    "dgpp:inter_token_latency_seconds",
)
STATS_LOGGER = "dgpp.engine.server.metrics.stats_log"


@pytest.fixture(scope="module")
def metered(default_checkpoint: Path) -> Iterator[RunningServer]:
    options = {"stats_log_interval_s": 0.2}
    # Speculative decoding on, so its families are exposed (they are empty without it).
    engine = {**DEFAULT_ENGINE, "speculative": "ngram"}
    with running_server(default_checkpoint, ("metered",), engine, options) as server:
        yield server


def documented_names() -> set[str]:
    return set(re.findall(r"`(dgpp:[a-z0-9_]+)`", DOCS.read_text()))


def service(server: RunningServer) -> dict[str, int]:
    response = httpx.get(f"{server.url}/v1/metrics", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["service"]


def scrape(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels without `le`) -> value; buckets are left
    out."""
    response = httpx.get(f"{server.url}/metrics", timeout=10)
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, model: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": model, **labels}.items())))]


def observations(samples: dict, model: str) -> dict[str, float]:
    """The `_count` of every latency histogram (TTFT summed over hit and miss)."""
    ttft = "dgpp:time_to_first_token_seconds_count"
    counts = {
        "ttft": value(samples, ttft, model, cache="hit") + value(samples, ttft, model, cache="miss")
    }
    for name in HISTOGRAMS:
        counts[name] = value(samples, f"{name}_count", model)
    return counts


def _chat(server: RunningServer, **fields: Any) -> httpx.Response:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "temperature": 0,
        **fields,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def _streamed_completion_tokens(server: RunningServer) -> int:
    body = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]["completion_tokens"]


def test_counters_move_by_exact_amounts(metered: RunningServer) -> None:
    metered.wait_idle()
    model = metered.model
    before, samples_before = service(metered), scrape(metered)

    tokens = [_chat(metered).json()["usage"]["completion_tokens"]]
    tokens.append(_streamed_completion_tokens(metered))
    message = httpx.post(
        f"{metered.url}/v1/messages",
        json={"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    assert message.status_code == 200, message.text
    tokens.append(message.json()["usage"]["output_tokens"])
    assert_error(_chat(metered, model="nope"), 404, "model_not_found", "model")
    bad = httpx.post(
        f"{metered.url}/v1/chat/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert_error(bad, 400, "invalid_json", None)
    assert httpx.get(f"{metered.url}/v1/models/nope").status_code == 404  # not a generation route

    after, samples_after = service(metered), scrape(metered)
    delta = {key: after[key] - before[key] for key in after}
    assert delta == {
        "requests_total": 5,
        "succeeded": 3,
        "failed": 0,
        "cancelled": 0,
        "shed": 0,
        "rejected": 2,
        "tokens_out": sum(tokens),
        "tool_calls_out": 0,
    }
    counts_before, counts_after = (
        observations(samples_before, model),
        observations(samples_after, model),
    )
    assert counts_after["ttft"] - counts_before["ttft"] == 3  # one per finished request
    assert counts_after[HISTOGRAMS[0]] - counts_before[HISTOGRAMS[0]] == 3
    assert counts_after[HISTOGRAMS[1]] - counts_before[HISTOGRAMS[1]] == 3
    gaps = sum(max(n - 1, 0) for n in tokens)
    assert counts_after[HISTOGRAMS[2]] - counts_before[HISTOGRAMS[2]] == gaps
    # Prometheus and JSON report the same service counters.
    assert value(samples_after, "dgpp:requests_total", model) == after["requests_total"]
    assert value(samples_after, "dgpp:request_success_total", model) == after["succeeded"]
    assert value(samples_after, "dgpp:request_rejected_total", model) == after["rejected"]
    assert value(samples_after, "dgpp:output_tokens_total", model) == after["tokens_out"]


def test_closed_stream_counts_as_cancelled(metered: RunningServer) -> None:
    metered.wait_idle()
    before = service(metered)
    body = {
        "model": metered.model,
        "prompt": "Count to one hundred:",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{metered.url}/v1/completions", json=body, timeout=60) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        next(events), next(events)  # generating
        events.close()
    metered.wait_idle()
    deadline = time.monotonic() + 10
    while service(metered)["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = service(metered)
    assert after["cancelled"] - before["cancelled"] == 1
    assert after["requests_total"] - before["requests_total"] == 1
    assert after["succeeded"] == before["succeeded"]


def test_prometheus_has_every_documented_name_with_the_model_label(metered: RunningServer) -> None:
    assert _chat(metered).status_code == 200  # every histogram has an observation
    response = httpx.get(f"{metered.url}/metrics", timeout=10)
    assert response.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(response.text))
    exposed = {family.name for family in families}
    exposed |= {sample.name for family in families for sample in family.samples}
    names = documented_names()
    assert len(names) >= 20
    # Exposed for models with recurrent layers only (tests/engine/models/test_qwen3_next.py reads
    # them).
    hybrid_only = {"dgpp:state_snapshots", "dgpp:state_snapshot_bytes"}
    hybrid_only.add("dgpp:state_snapshot_hits_total")
    # Exposed where rank 0 holds device memory (CUDA) only.
    cuda_only = {f"dgpp:device_memory_{kind}_bytes" for kind in ("allocated", "reserved", "total")}
    device = {f.name for f in families if f.name.startswith("dgpp:device_memory")}
    assert device in (set(), cuda_only)  # all three or none
    # Exposed where the deployment has side models (tests/appliance/runtime/test_side_models).
    side_only = {name for name in names if name.startswith("dgpp:side_model_")}
    assert len(side_only) == 6
    unseen = hybrid_only | cuda_only | side_only
    assert names - unseen <= exposed, names - unseen - exposed
    dgpp_samples = [s for f in families for s in f.samples if s.name.startswith("dgpp:")]
    assert dgpp_samples
    assert all(s.labels.get("model_name") == metered.model for s in dgpp_samples)
    assert {f.name for f in families if f.name.startswith("dgpp:")} <= names | {
        name.removesuffix("_total") for name in names
    }  # nothing exposed that the docs leave out


def test_json_has_every_documented_key(metered: RunningServer) -> None:
    body = httpx.get(f"{metered.url}/v1/metrics", timeout=10).json()
    assert isinstance(body.pop("sessions"), list)  # rows as GET /v1/sessions (keys below)
    assert body.pop("side_models") == []  # none here (tests/appliance/runtime/test_side_models)
    priorities = body.pop("priorities")  # keyed by the priorities seen: "0" here
    assert priorities and all(set(entry) == PRIORITY_KEYS for entry in priorities.values())
    assert {section: set(fields) for section, fields in body.items()} == JSON_KEYS
    docs = DOCS.read_text()
    for fields in [*JSON_KEYS.values(), PRIORITY_KEYS, SESSION_KEYS]:
        for field in fields:
            assert f"`{field}`" in docs, field
    spec = body["spec_decode"]
    assert (spec["method"], spec["depth"]) == ("ngram", 4)
    assert 0 <= spec["accepted"] <= spec["drafted"]
    assert sum(spec["per_position"]) == spec["accepted"]
    scheduler = body["scheduler"]
    assert scheduler["kv_blocks_total"] > 0
    assert 0 <= scheduler["kv_blocks_in_use"] <= scheduler["kv_blocks_total"]
    assert scheduler["kv_tokens_total"] == scheduler["kv_blocks_total"] * scheduler["kv_block_size"]
    memory = body["memory"]
    assert memory["host_rss_bytes"] > 0  # the server is a process of its own here
    on_device = memory["device_total_bytes"] is not None
    assert (memory["device_allocated_bytes"] is not None) == on_device


def test_stats_log_line_after_activity(
    metered: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    assert _chat(metered).status_code == 200
    deadline = time.monotonic() + 5
    lines: list[str] = []
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
        lines = [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER]
    assert lines, "no stats line within 5 s"
    assert re.fullmatch(
        r"prompt [\d.]+ tok/s, generation [\d.]+ tok/s, running \d+, waiting \d+, "
        r"KV cache [\d.]+% used, prefix cache hit rate (\S+), \d+ requests done",
        lines[0],
    ), lines[0]
