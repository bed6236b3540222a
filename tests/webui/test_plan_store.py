"""The Models page's fit column (issue 45): the console queues every row's memory plan when it
starts, stores each by the hash of what it depends on, and a console started again on the same
state finds them all."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import pytest

from dgpp.webui import console as console_module
from dgpp.webui.memory_preview import MemoryPreview
from dgpp.webui.plan_cache import PlanCache
from dgpp.webui.plan_store import PlanStore
from tests.webui.conftest import running_console
from tests.webui.fake_hub import allow_downloads


def test_plans_are_queued_at_start_and_stored_for_the_next_console(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45: the console computes every row's plan when it starts (the page asks for
    nothing), stores each, and a console started again on the same state finds them all: its
    first page has no row left checking and nothing is planned again."""
    allow_downloads(tmp_path, monkeypatch)  # this machine's checkpoints: none of the test's
    planned: list[str] = []

    def plan(deployment: Any, memory: Any) -> MemoryPreview:
        planned.append(deployment.model)
        return MemoryPreview("fits", "", model=deployment.model, device="a test Spark")

    monkeypatch.setattr(console_module, "PlanCache", functools.partial(PlanCache, plan))
    (tmp_path / "deployment.json").write_text(json.dumps({"template": "qwen3-8b_bfloat16_w1"}))
    with running_console(tmp_path, warm_plans=True) as console:
        assert console.login().status_code == 303
        deadline = time.monotonic() + 60
        while 'data-fits="checking"' in (page := console.client.get("/models").text):
            assert time.monotonic() < deadline, "the plans queued at start never finished"
            time.sleep(0.1)
        rows = page.count("data-candidate=")
        assert rows > 10 and len(planned) == rows
        stored = list((console.config.state_dir / "plans").glob("*.json"))
        assert len(stored) == rows
    with running_console(tmp_path, warm_plans=True) as console:
        assert console.login().status_code == 303
        page = console.client.get("/models").text
        assert 'data-fits="checking"' not in page and page.count('data-fits="fits"') == rows
    assert len(planned) == rows  # read back, not planned again


def test_a_stored_plan_reads_back_and_a_damaged_one_is_computed_again(tmp_path: Path) -> None:
    store = PlanStore(tmp_path / "plans")
    plan = MemoryPreview("refused", "too big", field="engine.kv_capacity", model="m")
    store.write("k1", plan)
    assert store.read("k1") == plan and store.read("k2") is None
    (tmp_path / "plans" / "k1.json").write_text('{"verdict": "fits", "ranks": [{"rank"')
    assert store.read("k1") is None  # cut short by a crash: not a plan
