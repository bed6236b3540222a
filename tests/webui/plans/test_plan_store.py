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

from dgpp.engine.planning.memory_plan import GIB, DeviceMemory
from dgpp.webui.core import console as console_module
from dgpp.webui.plans import cache as plan_cache
from dgpp.webui.plans.cache import PlanCache
from dgpp.webui.plans.memory_preview import MemoryPreview
from dgpp.webui.plans.store import PlanStore
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
    # One memory for every row: the host's free RAM, which CPU rows are planned against, moves
    # between the two consoles on a busy machine (tested below).
    fixed = DeviceMemory(128 * GIB, 100 * GIB, "a test Spark", is_accelerator=True)
    monkeypatch.setattr(plan_cache, "budget_memory", lambda deployment, gpu: fixed)
    (tmp_path / "deployment.json").write_text(json.dumps({"template": "qwen3-8b_bfloat16_w1"}))
    with running_console(tmp_path, warm_plans=True) as console:
        assert console.login().status_code == 303
        deadline = time.monotonic() + 60
        while 'data-fits="checking"' in (page := console.client.get("/models").text):
            assert time.monotonic() < deadline, "the plans queued at start never finished"
            time.sleep(0.1)
        rows = page.count("data-candidate=")
        assert rows > 10 and len(planned) == rows
        stored = [path.name for path in (console.config.state_dir / "plans").glob("*.json")]
        latest = [name for name in stored if name.startswith("latest-")]
        assert len(stored) - len(latest) == rows and len(latest) == rows
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


def test_the_latest_plan_stands_in_while_only_the_memory_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU deployment is planned against the host memory free now (to the GiB), which moves:
    the page's column shows the latest plan meanwhile and a new one is computed; a preview
    always plans against the memory now."""
    import threading

    from dgpp.appliance.deployments.deployment import parse_deployment

    calls: list[int] = []
    release = threading.Event()

    def plan(deployment: Any, memory: DeviceMemory) -> MemoryPreview:
        calls.append(memory.free_bytes // GIB)
        if len(calls) > 1:  # the recomputation waits until the stand-in has been seen
            release.wait(30)
        return MemoryPreview("fits", "", model=deployment.model, device=f"{calls[-1]} GiB free")

    cache = PlanCache(plan, gpu=lambda index: None)
    memory = [DeviceMemory(64 * GIB, 10 * GIB, "this host", is_accelerator=False)]
    monkeypatch.setattr(cache, "memory_for", lambda deployment: memory[0])
    deployment = parse_deployment({"model": "default", "engine": {"device": "cpu"}})
    first = cache.plan(deployment)
    assert cache.known(deployment) is first
    memory[0] = DeviceMemory(64 * GIB, 20 * GIB, "this host", is_accelerator=False)
    assert cache.known(deployment, schedule=True) is first  # stands in
    deadline = time.monotonic() + 30
    while calls != [10, 20]:
        assert time.monotonic() < deadline, calls
        time.sleep(0.05)
    assert cache.known(deployment) is first  # still, while the new plan is computed
    release.set()
    while cache.known(deployment) is first:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert cache.known(deployment).device == "20 GiB free"  # type: ignore[union-attr]
    assert cache.plan(deployment).device == "20 GiB free"
    cache.close()
