"""The change history on the fake world: every switch recorded (who, when, diff, phases,
outcome, duration) and still there after a console restart, the rollback's root cause, the
console's log, the History page and its JSON, and earlier deployments viewed and restored
through the preview and the safe switch."""

from __future__ import annotations

import html
import json
import logging
import re
from pathlib import Path

import pytest

from dgpp.webui.routes.deps import get_backend
from dgpp.webui.switch.job import ChangeRecord, Phase, Step, SwitchJob
from dgpp.webui.switch.log import SwitchLog
from tests.webui.conftest import DEPLOYMENT, USER, Console, hidden, running_console
from tests.webui.fakes import BROKEN_MODEL
from tests.webui.switch.test_root_cause import CONFIG_EXIT, MEMORY_PLAN

BIGGER = {**DEPLOYMENT, "engine": {**DEPLOYMENT["engine"], "kv_capacity": 4096}}


def _switch(console: Console, deployment: dict, title: str = "test") -> dict:
    console.apply(deployment, title)
    return console.wait_for_switch()


def _restore_preview(console: Console, ref: str) -> tuple[str, dict, str]:
    """The restore preview of `ref`: (its page, the deployment its Apply posts, its title)."""
    page = console.client.get(f"/history/deployments/{ref}/restore")
    assert page.status_code == 200, page.text
    deployment = json.loads(html.unescape(hidden(page.text, "deployment")))
    return page.text, deployment, html.unescape(hidden(page.text, "title"))


def test_a_switch_records_who_the_diff_the_phases_and_the_duration(logged_in: Console) -> None:
    job = _switch(logged_in, BIGGER, "Apply knobs")
    assert job["phase"] == "ready" and job["who"] == USER
    record = logged_in.client.get(f"/api/history/switches/{job['id']}").json()
    assert record["who"] == USER and record["title"] == "Apply knobs"
    assert record["changes"] == [{"path": "engine.kv_capacity", "old": "2048", "new": "4096"}]
    assert record["duration_s"] == pytest.approx(record["finished_at"] - record["started_at"])
    assert [step["phase"] for step in record["steps"]][-1] == "ready"
    assert json.loads(record["applied"]) == BIGGER
    assert json.loads(record["replaced"]) == DEPLOYMENT
    listed = logged_in.client.get("/api/history/switches").json()["switches"]
    assert [entry["id"] for entry in listed] == [job["id"]]


def test_the_history_survives_a_console_restart_and_ids_go_on(tmp_path: Path) -> None:
    with running_console(tmp_path) as first:
        first.login()
        done = _switch(first, BIGGER, "Before the restart")
        assert done["id"] == 1
    with running_console(tmp_path) as second:
        second.login()
        latest = second.client.get("/api/switch").json()["job"]
        assert (latest["id"], latest["title"], latest["who"]) == (1, "Before the restart", USER)
        assert "Before the restart" in second.client.get("/switch").text
        overview = second.client.get("/api/overview").json()
        assert overview["switch"]["id"] == 1
        again = _switch(second, DEPLOYMENT, "After the restart")
        assert again["id"] == 2
        rows = re.findall(r'data-switch-id="(\d+)"', second.client.get("/history").text)
        assert rows == ["2", "1"]


def test_a_switch_the_console_stopped_during_is_marked_failed(tmp_path: Path) -> None:
    journal = SwitchLog(tmp_path / "state" / "switches.sqlite")
    started = Step(1000.0, Phase.DRAINING, "stopping admission on the running engine")
    waiting = Step(1004.0, Phase.WAITING, "waiting up to 900 s for /health")
    change = (ChangeRecord("engine.kv_capacity", "2048", "4096"),)
    journal.save(
        SwitchJob(7, "Interrupted", change, 999.0, "admin", Phase.WAITING, (started, waiting))
    )
    journal.close()
    with running_console(tmp_path) as console:
        console.login()
        job = console.client.get("/api/switch").json()["job"]
        assert (job["id"], job["phase"], job["final"]) == (7, "failed", True)
        assert job["reason"].startswith("the console stopped during this switch (while waiting)")
        assert job["finished_at"] == 1004.0  # its last step, not the console's restart
        assert console.client.get("/api/switch").json()["busy"] is False
        assert _switch(console, BIGGER)["id"] == 8


def test_a_rolled_back_switch_gives_the_root_cause_as_its_reason(logged_in: Console) -> None:
    backend = logged_in.app.dependency_overrides[get_backend]()
    backend.log_tail = lambda rank, lines, run=None: (
        CONFIG_EXIT
    )  # what rank 0 printed before exiting 3
    job = _switch(logged_in, {**DEPLOYMENT, "model": BROKEN_MODEL, "http": {}}, "Too big")
    assert job["phase"] == "rolled back"
    assert job["reason"] == f"rank 0 failed: {MEMORY_PLAN}"
    assert job["steps"][-1]["message"] == f"back on /models/small: rank 0 failed: {MEMORY_PLAN}"
    page = logged_in.client.get("/history").text
    row = re.search(rf'<tr data-switch-id="{job["id"]}">(.*?)</tr>', page, re.S)
    assert row is not None
    assert "rolled back" in row.group(1) and "memory plan does not fit" in row.group(1)
    detail = logged_in.client.get(f"/history/{job['id']}").text
    assert 'id="switch-reason">rank 0 failed: ConfigError: this rank&#39;s memory plan' in detail
    assert 'id="switch-log"' in detail and "Uvicorn running" in detail


def test_the_console_log_records_each_switch(
    logged_in: Console, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="dgpp.webui.switch.switcher"):
        job = _switch(logged_in, BIGGER, "Apply knobs")
        broken = _switch(logged_in, {**DEPLOYMENT, "model": BROKEN_MODEL, "http": {}}, "Broken")
    messages = [r.getMessage() for r in caplog.records if r.name == "dgpp.webui.switch.switcher"]
    assert f"switch {job['id']} started by {USER}: Apply knobs; changes: engine.kv_capacity" in (
        messages
    )
    assert any(
        re.fullmatch(rf"switch {job['id']} ready after \d+\.\d s: serving .*", m) for m in messages
    )
    ended = [
        r for r in caplog.records if r.getMessage().startswith(f"switch {broken['id']} rolled back")
    ]
    assert len(ended) == 1 and ended[0].levelno == logging.WARNING
    assert "cannot load the model" in ended[0].getMessage()


def test_the_history_page_lists_switches_and_kept_files(logged_in: Console) -> None:
    assert 'id="no-switches"' in logged_in.client.get("/history").text
    job = _switch(logged_in, BIGGER, "Apply knobs")
    page = logged_in.client.get("/history")
    assert page.status_code == 200
    assert '<a href="/history" class="active" aria-current="page">History</a>' in page.text
    row = re.search(rf'<tr data-switch-id="{job["id"]}">(.*?)</tr>', page.text, re.S)
    assert row is not None
    cells = re.findall(r'<td class="(who|title|outcome|duration)">(.*?)</td>', row.group(1), re.S)
    text = {name: re.sub(r"<[^>]+>", "", value).strip() for name, value in cells}
    assert text["who"] == USER and text["title"] == "Apply knobs" and text["outcome"] == "ready"
    assert re.fullmatch(r"\d+\.\d s", text["duration"])
    kept = re.findall(r'<tr data-kept="([^"]+)">', page.text)
    assert len(kept) == 1  # the file the switch replaced
    view = logged_in.client.get(f"/history/deployments/{kept[0]}")
    shown = re.search(r'<pre class="log" id="deployment-json"[^>]*>(.*?)</pre>', view.text, re.S)
    assert shown is not None
    assert json.loads(html.unescape(shown.group(1))) == DEPLOYMENT
    assert f'id="restore-{kept[0]}"' in view.text


def test_the_switch_detail_shows_its_diff_phases_and_deployments(logged_in: Console) -> None:
    job = _switch(logged_in, BIGGER, "Apply knobs")
    page = logged_in.client.get(f"/history/{job['id']}")
    assert page.status_code == 200
    assert f'id="switch-who">{USER}<' in page.text
    assert re.findall(r'<td class="key">([^<]+)</td>', page.text) == ["engine.kv_capacity"]
    phases = re.findall(r'<li data-phase="([^"]+)">', page.text)
    assert phases[0] == "draining" and phases[-1] == "ready"
    for which in ("applied", "replaced"):
        assert f'id="restore-switch-{job["id"]}-{which}"' in page.text
    applied = logged_in.client.get(f"/history/deployments/switch-{job['id']}-applied")
    assert "&#34;kv_capacity&#34;: 4096" in applied.text


@pytest.mark.parametrize(
    "path",
    [
        "/history/999",
        "/history/deployments/switch-999-applied",
        "/history/deployments/deployment-20260101-000000-000000000",
        "/history/deployments/webui.credentials",  # a file, but no kept deployment
        "/history/deployments/switch-999-replaced/restore",
    ],
)
def test_unknown_ids_are_404_with_a_clear_message(logged_in: Console, path: str) -> None:
    response = logged_in.client.get(path)
    assert response.status_code == 404
    assert re.search(
        r'id="history-error" role="alert">no (switch 999 in the history|earlier deployment named)',
        response.text,
    )


def test_an_unknown_switch_in_the_api_is_404(logged_in: Console) -> None:
    response = logged_in.client.get("/api/history/switches/999")
    assert response.status_code == 404
    assert response.json() == {"error": "no switch 999 in the history"}


def test_a_replaced_deployment_is_restored_through_the_preview_and_the_switch(
    logged_in: Console,
) -> None:
    first = _switch(logged_in, BIGGER, "Apply knobs")
    assert logged_in.written() == BIGGER
    before = list(logged_in.world.actions)
    page, deployment, title = _restore_preview(logged_in, f"switch-{first['id']}-replaced")
    assert logged_in.world.actions == before  # a preview changes nothing
    rows = re.findall(
        r'<td class="key">([^<]+)</td><td class="old">([^<]+)</td><td class="new">([^<]+)</td>',
        page,
    )
    assert rows == [("engine.kv_capacity", "4096", "2048")]
    assert deployment == DEPLOYMENT and 'id="apply"' in page
    assert title == f"Restore the deployment switch {first['id']} replaced"
    restored = _switch(logged_in, deployment, title)
    assert restored["phase"] == "ready" and restored["id"] == first["id"] + 1
    assert logged_in.written() == DEPLOYMENT
    record = logged_in.client.get(f"/api/history/switches/{restored['id']}").json()
    assert record["title"] == title and record["who"] == USER
    assert json.loads(record["applied"]) == DEPLOYMENT


def test_a_kept_file_is_restored_too(logged_in: Console) -> None:
    _switch(logged_in, BIGGER)
    _switch(logged_in, {**BIGGER, "engine": {**BIGGER["engine"], "kv_capacity": 8192}})
    kept = re.findall(r'<tr data-kept="([^"]+)">', logged_in.client.get("/history").text)
    assert len(kept) == 2
    _, deployment, title = _restore_preview(logged_in, kept[-1])  # the oldest: the first file
    assert deployment == DEPLOYMENT and title.startswith(f"Restore the kept file {kept[-1]}.json")
    assert _switch(logged_in, deployment, title)["phase"] == "ready"
    assert logged_in.written() == DEPLOYMENT


def test_an_invalid_earlier_deployment_is_refused_with_every_problem(logged_in: Console) -> None:
    backups = logged_in.config.state_dir / "deployments"
    backups.mkdir(parents=True, exist_ok=True)
    name = "deployment-20260101-000000-000000001"
    invalid = {"model": "m", "engine": {"kv_capacity": -1, "prefill_precision": "fp8"}}
    (backups / f"{name}.json").write_text(json.dumps(invalid))
    response = logged_in.client.get(f"/history/deployments/{name}/restore")
    assert response.status_code == 400
    problems = re.findall(r"<li>([^<]+)</li>", response.text.split('id="restore-problems"')[1])
    assert [p.split(":")[0] for p in problems] == ["engine.kv_capacity", "engine.prefill_precision"]
    assert 'id="apply"' not in response.text
    assert logged_in.world.actions == []


def test_applying_a_restore_needs_the_csrf_token(logged_in: Console) -> None:
    first = _switch(logged_in, BIGGER)
    before = list(logged_in.world.actions)
    _, deployment, title = _restore_preview(logged_in, f"switch-{first['id']}-replaced")
    response = logged_in.client.post(
        "/switch",
        data={"deployment": json.dumps(deployment), "title": title, "csrf_token": "forged"},
        follow_redirects=False,
    )
    assert response.status_code == 403
    assert logged_in.world.actions == before and logged_in.written() == BIGGER
    assert logged_in.client.get("/api/history/switches").json()["switches"][0]["id"] == first["id"]


def test_the_history_needs_a_login(console: Console) -> None:
    response = console.client.get("/history", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"].startswith("/login")
    assert console.client.get("/api/history/switches").status_code == 401
    assert (
        console.client.get("/history/deployments/x/restore", follow_redirects=False).status_code
        == 303
    )
