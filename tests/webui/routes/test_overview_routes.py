"""Overview, history and logs through the routes, on the fake world."""

from __future__ import annotations

import html
import io
import json
import tarfile
import time
from pathlib import Path

import pytest

from dgpp.appliance.common.paths import deployment_log_dir
from dgpp.appliance.deployments.files import deployment_id
from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput, RequestTimings
from dgpp.engine.server.metrics.service import Outcome
from dgpp.webui.deployments.store import resolve_raw
from dgpp.webui.monitor.kernel_view import CPU_NOTE, FALLBACK_HINT
from tests.webui.conftest import DEPLOYMENT, Console, running_console
from tests.webui.fakes import BROKEN_MODEL, PTXAS_REASON, SELF_CHECK, node_snapshot


def test_overview_reports_deployment_health_ranks_and_node(logged_in: Console) -> None:
    body = logged_in.client.get("/api/overview").json()
    assert body["deployment"]["model"] == "/models/small"
    assert body["deployment"]["served_names"] == ["m"]
    assert body["health"]["state"] == "serving" and body["health"]["serving"]
    assert body["ranks"][0]["state"] == "running" and body["ranks"][0]["uptime_s"] >= 0
    assert body["nodes_source"] == "engine"
    assert [(node["rank"], node["hostname"]) for node in body["nodes"]] == [
        (0, "spark-1"),
        (1, "spark-2"),
    ]
    logged_in.world.state = "down"
    body = logged_in.client.get("/api/overview").json()
    assert body["health"]["state"] == "unreachable"
    assert "connection refused" in body["health"]["reason"]
    # Without rank 0 the console shows what it can read itself: this node, rank unknown.
    assert body["nodes_source"] == "local"
    (node,) = body["nodes"]
    assert node["rank"] is None and set(node["summary"]) >= {"gpus", "cpu_freq", "governor"}
    page = logged_in.client.get("/")
    assert "unreachable" in page.text and 'id="chart-throughput"' in page.text
    assert "This node only: the engine does not answer." in page.text


def test_overview_shows_one_row_per_node_and_warns_per_node(logged_in: Console) -> None:
    slow = node_snapshot(1, "spark-2", sm_clock_mhz=900, target_clock_mhz=2400, utilisation_pct=97)
    silent = {"rank": 2, "hostname": None, "time": None, "age_s": None, "error": "no reading yet"}
    logged_in.world.nodes = [node_snapshot(0, "spark-1"), slow, silent]
    body = logged_in.client.get("/api/overview").json()
    assert body["warnings"] == [
        "rank 1 (spark-2): GPU 0 runs at 900 MHz, 38% of its 2400 MHz target, while 97% busy"
    ]
    assert [node["warnings"] != [] for node in body["nodes"]] == [False, True, False]
    page = logged_in.client.get("/").text
    rows = page.split('id="nodes"', 1)[1].split("</table>", 1)[0].count("<tr><td>")
    assert rows == 3
    for text in ("spark-2", "SM 900 of 2400 MHz", "unavailable: no driver", "no reading yet"):
        assert text in page
    assert "performance" in page and "1.50 1.25 1.00" in page and 'class="warning"' in page


def test_the_sampler_fills_the_history_from_the_engine(tmp_path: Path) -> None:
    with running_console(tmp_path, sample_interval_s=0.05) as console:
        client = console.client
        assert console.login().status_code == 303
        deadline = time.monotonic() + 10
        series: dict = {}
        while time.monotonic() < deadline:
            series = client.get("/api/history", params={"window_s": 60}).json()["series"]
            if len(series["ts"]) >= 3:
                break
            time.sleep(0.05)
    assert len(series["ts"]) >= 3
    assert series["kv_total"][-1] == 64 and series["running"][-1] == 1
    assert series["kv_used_pct"][-1] == 6.25 and series["kv_tokens_total"][-1] == 1024
    assert series["host_rss_bytes"][-1] == 3 << 30
    assert series["device_reserved_bytes"][-1] == 24 << 30
    assert series["gen_tps"][-1] == 0.0  # the fake's counters stand still
    assert series["succeeded_rps"][-1] == 0.0
    assert series["ttft_p50_s"][-1] is None  # nothing finished in the interval
    assert "ttft_hit_s" not in series  # the engine's mean since start is not charted


def _finished(ttft: float) -> RequestOutput:
    timings = RequestTimings(arrival=0.0, first_scheduled=0.0, first_token=ttft, finished=1.0)
    completion = CompletionOutput(0, "x", (1, 2), "stop")
    return RequestOutput("r", None, (1,), (completion,), True, timings=timings)


def test_the_history_has_the_percentiles_and_outcomes_of_each_interval(tmp_path: Path) -> None:
    with running_console(tmp_path, sample_interval_s=0.05) as console:
        assert console.login().status_code == 303
        before = time.time()
        service = console.world.service
        for _ in range(4):  # TTFT 0.3 s: in the engine's (0.25, 0.5] bucket
            service.record_outcome(Outcome.SUCCEEDED)
            service.record_finished(_finished(0.3))
        service.record_outcome(Outcome.SHED)
        deadline = time.monotonic() + 10
        body: dict = {}
        while time.monotonic() < deadline:
            body = console.client.get("/api/history", params={"window_s": 60}).json()
            if any(value is not None for value in body["series"]["ttft_p95_s"]):
                break
            time.sleep(0.05)
    series = body["series"]
    (index,) = [i for i, value in enumerate(series["ttft_p95_s"]) if value is not None]
    assert series["ttft_p50_s"][index] == pytest.approx(0.25 + 0.25 * 2 / 4)
    assert series["ttft_p95_s"][index] == pytest.approx(0.25 + 0.25 * 0.95)
    assert series["e2e_p50_s"][index] is not None
    # The outcomes arrived between two samples: one interval has them all.
    assert sum(1 for value in series["succeeded_rps"] if value) == 1
    assert sum(1 for value in series["shed_rps"] if value) == 1
    assert body["window_s"] == 60 and before <= body["now"] <= time.time()
    assert body["events"] == []


def test_history_marks_each_switch_in_its_window(logged_in: Console) -> None:
    logged_in.apply(
        {**DEPLOYMENT, "engine": {**DEPLOYMENT["engine"], "kv_capacity": 4096}}, "More KV"
    )
    job = logged_in.wait_for_switch()
    assert job["phase"] == "ready"
    body = logged_in.client.get("/api/history", params={"window_s": 900}).json()
    assert body["events"] == [
        {
            "id": job["id"],
            "at": job["finished_at"],
            "phase": "ready",
            "title": "More KV",
            "reason": None,
        }
    ]
    assert body["now"] - 900 <= job["finished_at"] <= body["now"]
    # Windows end now: one too short to reach back to the switch has no marker.
    time.sleep(0.3)
    assert logged_in.client.get("/api/history", params={"window_s": 0.1}).json()["events"] == []


def _banner(page: str) -> str:
    return page.split('id="rollback-banner"', 1)[1].split("</div>", 1)[0]


def test_a_rollback_leaves_a_banner_until_a_later_switch_succeeds(logged_in: Console) -> None:
    assert logged_in.client.get("/api/overview").json()["rollback"] is None
    assert _banner(logged_in.client.get("/").text).startswith(
        ' class="banner banner-bad" role="alert" hidden>'
    )
    logged_in.apply({**DEPLOYMENT, "model": BROKEN_MODEL, "http": {}}, "Switch to broken")
    job = logged_in.wait_for_switch()
    assert job["phase"] == "rolled back"
    rollback = logged_in.client.get("/api/overview").json()["rollback"]
    assert rollback == {
        "id": job["id"],
        "phase": "rolled back",
        "title": "Switch to broken",
        "reason": job["reason"],
        "at": job["finished_at"],
    }
    assert job["reason"].startswith("rank 0 failed")
    banner = _banner(logged_in.client.get("/").text)
    assert " hidden>" not in banner
    assert "Switch to broken" in banner and html.escape(job["reason"]) in banner
    events = logged_in.client.get("/api/history", params={"window_s": 900}).json()["events"]
    assert [(event["phase"], event["reason"]) for event in events] == [
        ("rolled back", job["reason"])
    ]
    # The engine serves the previous deployment again, yet the banner stays ...
    assert logged_in.client.get("/api/overview").json()["health"]["serving"]
    # ... until a later switch is kept.
    logged_in.apply({**DEPLOYMENT, "engine": {**DEPLOYMENT["engine"], "kv_capacity": 4096}}, "Fix")
    assert logged_in.wait_for_switch()["phase"] == "ready"
    assert logged_in.client.get("/api/overview").json()["rollback"] is None
    assert " hidden>" in _banner(logged_in.client.get("/").text)


def test_logs_show_a_rank_tail(logged_in: Console) -> None:
    page = logged_in.client.get("/logs", params={"rank": 0, "lines": 50})
    assert page.status_code == 200 and "rank0 INFO serving" in page.text
    body = logged_in.client.get("/api/logs/1", params={"lines": 5}).json()
    assert (body["rank"], body["lines"], body["text"]) == (1, 5, "rank1 INFO serving")
    assert logged_in.client.get("/api/logs/0", params={"lines": 0}).status_code == 422


def test_support_bundle_download(logged_in: Console) -> None:
    deployment = resolve_raw(json.loads(logged_in.config.deployment.read_text()))
    folder = deployment_log_dir(deployment_id(deployment))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rank0.log").write_text("Authorization: Bearer sk-abcdefghijkl\nready\n")
    response = logged_in.client.post("/logs/bundle", data={"csrf_token": logged_in.csrf()})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        names = tar.getnames()
        log = next(name for name in names if name.endswith("rank0.log"))
        text = tar.extractfile(log).read().decode()  # type: ignore[union-attr]
    assert "sk-abcdefghijkl" not in text and "ready" in text
    assert not list(logged_in.config.state_dir.glob("dgpp-bundle-*"))  # removed after sending


def test_the_overview_warns_while_the_api_is_open_to_the_network_without_a_key(
    tmp_path: Path,
) -> None:
    from tests.webui.conftest import DEPLOYMENT

    open_api = {**DEPLOYMENT, "http": {**DEPLOYMENT.get("http", {}), "host": "0.0.0.0"}}
    open_api["http"]["allow_unauthenticated"] = True
    (tmp_path / "deployment.json").write_text(json.dumps(open_api))
    with running_console(tmp_path) as console:
        assert console.login().status_code == 303
        warnings = console.client.get("/api/overview").json()["warnings"]
        assert warnings[0].startswith("The API on 0.0.0.0:") and "without a key" in warnings[0]
        assert "without a key" in console.client.get("/").text
    keyed = {**open_api, "http": {**open_api["http"], "api_key_file": str(tmp_path / "key")}}
    (tmp_path / "key").write_text("k\n")
    (tmp_path / "deployment.json").write_text(json.dumps(keyed))
    with running_console(tmp_path) as console:
        assert console.login().status_code == 303
        assert console.client.get("/api/overview").json()["warnings"] == []


def test_the_kernels_panel_shows_a_fallback_and_its_reason(logged_in: Console) -> None:
    body = logged_in.client.get("/api/overview").json()
    assert body["kernels"]["note"].startswith("the engine reports no kernel self-check")
    logged_in.world.self_check = SELF_CHECK
    body = logged_in.client.get("/api/overview").json()
    assert body["kernels"]["fallbacks"] == ["paged_attention"]
    assert any("paged_attention fell back" in warning for warning in body["warnings"])
    page = logged_in.client.get("/").text
    panel = html.unescape(page.split('id="kernels-card"', 1)[1].split("</section>", 1)[0])
    assert PTXAS_REASON in panel and FALLBACK_HINT in panel
    assert 'class="kernel-fallback"' in panel and "103.2 Gb/s" in panel
    logged_in.world.self_check = {"kernels": {}, "kernel_checks": [], "allreduce": []}
    assert CPU_NOTE in logged_in.client.get("/").text


def test_history_by_model(logged_in: Console) -> None:
    """The charts show one model at a time: the main model's rows by default, a side model's
    by its name; the body lists the side models the history holds (the page's choice)."""
    from dgpp.webui.monitor.history import Sample

    store = logged_in.app.state.console.history
    now = time.time()
    store.add(Sample(now - 2, 1, gen_tps=7.0), "emb")
    store.add(Sample(now - 1, 1, gen_tps=9.0), "emb")
    side = logged_in.client.get("/api/history", params={"window_s": 60, "model": "emb"}).json()
    assert side["model"] == "emb" and side["series"]["gen_tps"] == [7.0, 9.0]
    assert side["models"] == ["emb"]
    main = logged_in.client.get("/api/history", params={"window_s": 60}).json()
    assert 7.0 not in main["series"]["gen_tps"] and main["models"] == ["emb"]
    other = logged_in.client.get("/api/history", params={"window_s": 60, "model": "x"}).json()
    assert other["series"]["ts"] == []
