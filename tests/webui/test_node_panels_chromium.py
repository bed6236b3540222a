"""The overview's Kernels and Node health panels in headless Chromium (Playwright, the system's
/usr/bin/chromium): a console on the fake world (its rank 0 reports a kernel that fell back) and
a recorded Spark as its node, served by uvicorn. The fallback's reason shows, the cases fold
under their details, the page's refresh redraws the panel, and the doctor's badges fill in.

The screenshot is copied to $DGPP_TEST_ARTIFACTS/webui-node-panels/ (default
build/test-artifacts/webui-node-panels/)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from dgpp.webui.app import create_app
from dgpp.webui.monitor.kernel_view import FALLBACK_HINT
from dgpp.webui.monitor.node_health import NodeDoctor
from dgpp.webui.routes.deps import get_backend, get_engine_factory
from dgpp.webui.routes.doctor_routes import get_node_doctor
from dgpp.webui.routes.overview_routes import get_nodes_factory
from tests.appliance.doctor.node import gpu_tools, probe, spark_root
from tests.engine.server.harness import free_port
from tests.webui.conftest import PASSWORD, USER, console_config
from tests.webui.e2e_harness import CHROMIUM, DEFAULT_ARTIFACTS, VIEWPORT, chromium
from tests.webui.fakes import PTXAS_REASON, SELF_CHECK, FakeBackend, FakeEngine, FakeWorld

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install -y chromium)"
)
WAIT_MS = 15_000
NORM_REASON = "error 3.1e-01 above the bfloat16 tolerance 2e-02"


@contextmanager
def served_console(
    tmp_path: Path, world_check: dict[str, object]
) -> Iterator[tuple[str, FakeWorld]]:
    """The console on a fake world, over HTTP; its doctor reads a PD-throttled Spark."""
    config = console_config(tmp_path, port=free_port())
    world = FakeWorld(config.deployment, self_check=world_check)
    world.restart()
    backend = FakeBackend(world)
    gpu_tools(tmp_path / "bin", "gb10_pd_throttled")
    doctor = NodeDoctor(probe(spark_root(tmp_path / "root"), tmp_path / "bin"))
    app = create_app(config, backend=backend)
    app.dependency_overrides[get_backend] = lambda: backend
    app.dependency_overrides[get_engine_factory] = lambda: lambda d: FakeEngine(world, d)
    app.dependency_overrides[get_nodes_factory] = lambda: lambda d: FakeEngine(world, d)
    app.dependency_overrides[get_node_doctor] = lambda: doctor
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="console", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{config.port}", world
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_the_overview_shows_kernels_and_node_health(tmp_path: Path) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with served_console(tmp_path, SELF_CHECK) as (url, world), chromium() as browser:
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(f"{url}/")
        page.wait_for_url("**/login?next=*", timeout=WAIT_MS)
        page.fill("input[name=username]", USER)
        page.fill("input[name=password]", PASSWORD)
        page.click("#login-submit")
        page.wait_for_url(f"{url}/", timeout=WAIT_MS)

        fallback = page.locator("#kernels tr.kernel-fallback")
        assert fallback.locator("td").nth(0).inner_text() == "paged_attention"
        assert PTXAS_REASON in fallback.inner_text() and FALLBACK_HINT in fallback.inner_text()
        cases = page.locator("#kernel-cases")
        assert not cases.locator("table").is_visible()  # folded until asked for
        cases.locator("summary").click()
        assert "did not run (tolerance 2e-02)" in cases.inner_text()
        assert "103.2 Gb/s" in page.inner_text("#allreduce")

        # The doctor's findings arrive from /api/doctor: the throttled GPU fails.
        failing = page.locator("#node-health tbody tr", has=page.locator(".check-fail"))
        failing.first.wait_for(timeout=WAIT_MS)
        assert "gpu0" in failing.first.inner_text() and "FAIL" in failing.first.inner_text()
        assert "fail" in page.inner_text("#node-health-summary")
        page.screenshot(path=str(shots / "overview-node-panels.png"), full_page=True)

        # The overview's refresh redraws the panel from /api/overview.
        world.self_check = {**SELF_CHECK, "kernels": {"rms_norm": f"fallback: {NORM_REASON}"}}
        page.locator("#kernels tr.kernel-fallback", has_text=NORM_REASON).wait_for(timeout=WAIT_MS)
        assert page.locator("#kernels tbody tr").count() == 1
    target = Path(os.environ.get("DGPP_TEST_ARTIFACTS") or DEFAULT_ARTIFACTS) / "webui-node-panels"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(shots, target)
