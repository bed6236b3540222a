"""The previews' KV-cache dtype rows through the routes on the fake world: the knob preview's
memory plan shows rank 0 at each `engine.kv_cache_dtype` with the configured one marked (all
four, on CPU and on CUDA), and the Models page's
`/api/models/fits` carries the same rows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from dgpp.appliance.deployments.deployment import Deployment
from dgpp.engine.planning.memory_plan import DeviceMemory
from dgpp.webui.app import console_of
from dgpp.webui.plans.cache import PlanCache
from dgpp.webui.plans.memory_preview import MemoryPreview, preview_memory
from tests.webui.fake_hub import allow_downloads
from tests.webui.routes.test_model_routes import QWEN3_8B, console_with, wait_for_fits

SMOLLM2 = "smollm2-135m_float32_w1"  # the default model, on CPU: host RAM is the budget
DTYPES = ["auto", "fp8_e4m3", "int8", "int4"]


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No checkpoints on this machine: Qwen3-8B is planned from its shipped facts."""
    return allow_downloads(tmp_path, monkeypatch)


def in_thread(deployment: Deployment, memory: DeviceMemory) -> MemoryPreview:
    """The real planner, which `PlanCache` runs in its own thread rather than its worker."""
    return preview_memory(deployment, memory)


def kv_rows(html: str) -> dict[str, dict[str, Any]]:
    """The KV dtype table of a page: per dtype its data-* attributes and cells' text."""
    table = re.search(r'<table class="list" id="kv-dtypes">(.*?)</table>', html, re.S)
    assert table is not None, "no KV dtype table"
    rows = {}
    for attributes, body in re.findall(
        r"<tr (data-kv-dtype[^>]*)>(.*?)</tr>", table.group(1), re.S
    ):
        data = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', attributes))
        cells = [
            re.sub(r"<[^>]+>", "", cell).strip()
            for cell in re.findall(r"<td[^>]*>(.*?)</td>", body, re.S)
        ]
        rows[data["kv-dtype"]] = {**data, "cells": cells}
    return rows


def test_the_knob_preview_shows_every_kv_dtype_on_cpu(default_checkpoint, tmp_path) -> None:
    with console_with(tmp_path, {"template": SMOLLM2, "world_size": 1}) as console:
        response = console.preview_knobs({"engine.kv_cache_dtype": "int8"})
        assert response.status_code == 200, response.text
        assert 'id="kv-dtype">KV cache dtype: <code>int8</code>' in response.text
        rows = kv_rows(response.text)
        assert list(rows) == DTYPES
        assert [row["configured"] for row in rows.values()] == ["false", "false", "true", "false"]
        assert 'class="configured"' in response.text and "configured</span>" in response.text
        assert all(row["refused"] == "false" and len(row["cells"]) == 5 for row in rows.values())
        # SmolLM2-135M in float32: 30 layers x K,V x 3 kv heads x dim 64 x 4 bytes; int8 in
        # 32-value blocks with a 2-byte scale each (ggml's Q8_0)
        assert rows["auto"]["cells"][1:3] == ["46,080 B", "23,301"]
        assert rows["int8"]["cells"][1:3] == ["12,240 B", "87,724"]
        assert "sessions of 8,192 tokens" in response.text


def test_on_cuda_every_dtype_is_planned(machine, tmp_path) -> None:
    with console_with(tmp_path, QWEN3_8B) as console:
        response = console.preview_knobs({"engine.kv_capacity": "65536"})
        assert response.status_code == 200, response.text
        rows = kv_rows(response.text)
        assert list(rows) == DTYPES
        assert rows["auto"]["configured"] == "true" and rows["auto"]["refused"] == "false"
        assert rows["auto"]["cells"][1:] == ["147,456 B", "7,281", "40,960", "14"]
        assert rows["int8"]["cells"][1] == "78,336 B"  # 36 layers x K,V x 8 heads x 136 bytes
        assert all(rows[name]["refused"] == "false" for name in DTYPES[1:])

        # The Models page's JSON carries the same rows; its background plans in a thread here
        # (the worker process takes seconds to start).
        console_of(console.app).plans = PlanCache(in_thread, gpu=lambda index: None)
        key = "template:qwen3-8b_bfloat16_w1"
        fit = wait_for_fits(console, [key])[key]
        assert fit["kv_dtype"] == "auto"
        assert [row["kv_dtype"] for row in fit["kv_dtypes"]] == DTYPES
        assert fit["kv_dtypes"][0] == {
            "kv_dtype": "auto",
            "bytes_per_token": 147456,
            "tokens_per_gib": 7281,
            "largest_context": 40960,
            "sessions": 14,  # of the template's 32,768 tokens
            "refused": "",
        }
        assert not any(row["refused"] for row in fit["kv_dtypes"])
