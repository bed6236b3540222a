"""Models, knobs and the safe switch through the routes, on the fake world: validation errors
per field with nothing restarted, the diff, drain -> write -> restart -> ready, and the automatic
rollback when the new deployment cannot load."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.webui.conftest import DEPLOYMENT, Console, hidden
from tests.webui.fakes import BROKEN_MODEL


def test_an_invalid_knob_shows_its_error_and_restarts_nothing(logged_in: Console) -> None:
    before = logged_in.config.deployment.read_text()
    response = logged_in.preview_knobs(
        {
            "engine.kv_capacity": "lots",
            "engine.prefill_chunk_tokens": "0",
            "engine.prefill_precision": "fp8",
            "http.default_chat_template_kwargs": "[1, 2]",
        }
    )
    assert response.status_code == 400
    errors = dict(re.findall(r'id="error-([^"]+)">([^<]+)<', response.text))
    # Every mistake in one pass: conversions and the schema's bounds alike.
    assert errors == {
        "engine.kv_capacity": "must be a whole number",
        "engine.prefill_chunk_tokens": "Input should be greater than or equal to 1",
        "engine.prefill_precision": "must be one of fp32, model",
        "http.default_chat_template_kwargs": "must be a JSON object",
    }
    # The typed values come back so the operator can fix them.
    assert 'value="lots"' in response.text
    response = logged_in.preview_knobs({"engine.prefill_chunk_tokens": "0"})
    assert response.status_code == 400
    assert 'id="error-engine.prefill_chunk_tokens">Input should be greater than or equal to 1' in (
        response.text
    )
    assert logged_in.world.actions == []
    assert logged_in.config.deployment.read_text() == before


def test_a_cross_field_rule_of_the_runtime_is_reported_on_its_field(logged_in: Console) -> None:
    response = logged_in.preview_knobs(
        {"timeouts.heartbeat_s": "100", "timeouts.control_deadline_s": "120"}
    )
    assert response.status_code == 400
    assert 'id="error-timeouts.heartbeat_s">heartbeat_s (100.0) must be at most half' in (
        response.text
    )
    assert logged_in.world.actions == []


def test_a_valid_knob_shows_the_diff_then_applies_through_the_switch(logged_in: Console) -> None:
    preview = logged_in.preview_knobs(
        {
            "engine.kv_capacity": "4096",
            "engine.prefix_cache": "off",
            "http.served_model_names": "m, m-alias",
        }
    )
    assert preview.status_code == 200, preview.text
    rows = re.findall(r'<td class="key">([^<]+)</td><td class="old">([^<]+)</td>', preview.text)
    assert rows == [
        ("engine.kv_capacity", "2048"),
        ("engine.prefix_cache", "true"),
        ("http.served_model_names", "[&#34;m&#34;]"),
    ]
    assert logged_in.world.actions == []  # a preview changes nothing
    deployment = json.loads(hidden(preview.text, "deployment").replace("&#34;", '"'))
    # Only what changed is written; the file keeps its shape.
    assert deployment == {
        **DEPLOYMENT,
        "engine": {**DEPLOYMENT["engine"], "kv_capacity": 4096, "prefix_cache": False},
        "http": {"served_model_names": ["m", "m-alias"]},
    }
    logged_in.apply(deployment, "Apply knobs")
    job = logged_in.wait_for_switch()
    assert job["phase"] == "ready", job
    assert logged_in.world.actions == ["drain", "restart"]
    assert logged_in.written()["engine"]["kv_capacity"] == 4096
    messages = [step["message"] for step in job["steps"]]
    assert messages[0] == "stopping admission on the running engine"
    assert "drained: no request running or waiting" in messages
    assert messages[-1].startswith("serving /models/small as m, m-alias")
    page = logged_in.client.get("/switch")
    assert "Apply knobs" in page.text and "ready" in page.text


def test_live_knobs_alone_are_reloaded_without_a_restart(logged_in: Console) -> None:
    """Only live knobs changed: the file is written and rank 0 reloads it; nothing drains or
    restarts."""
    live = {
        **DEPLOYMENT,
        "engine": {**DEPLOYMENT["engine"], "step_target_ms": 40.0},
        "http": {"served_model_names": ["m", "m-alias"], "queue_limit": 8},
    }
    logged_in.apply(live, "Tune")
    job = logged_in.wait_for_switch()
    assert job["phase"] == "ready", job
    assert logged_in.world.actions == ["reload"]
    assert logged_in.written() == live
    assert [step["phase"] for step in job["steps"]] == ["writing", "reloading", "ready"]
    assert job["steps"][-1]["message"] == (
        "applied live, no restart: engine.step_target_ms 0.0 -> 40.0, http.queue_limit 256 -> 8, "
        'http.served_model_names ["m"] -> ["m", "m-alias"]'
    )


def test_a_reload_rank_0_does_not_take_falls_back_to_the_restart(logged_in: Console) -> None:
    logged_in.world.refuse_reload = True  # an older rank 0 without POST /admin/reload
    live = {**DEPLOYMENT, "engine": {**DEPLOYMENT["engine"], "step_target_ms": 40.0}}
    logged_in.apply(live)
    job = logged_in.wait_for_switch()
    assert job["phase"] == "ready", job
    assert logged_in.world.actions == ["drain", "restart"]
    messages = [step["message"] for step in job["steps"]]
    assert "rank 0 did not reload (HTTP 404); restarting it" in messages
    assert logged_in.written() == live


def test_a_model_preview_validates_the_checkpoint(logged_in: Console) -> None:
    response = logged_in.client.post(
        "/models/preview",
        data={"csrf_token": logged_in.csrf(), "model": "/nowhere/model", "served_name": "x"},
    )
    assert response.status_code == 400
    assert "no such checkpoint directory: /nowhere/model" in response.text
    response = logged_in.client.post(
        "/models/preview", data={"csrf_token": logged_in.csrf(), "template": "no-such"}
    )
    assert response.status_code == 400
    assert "no template named" in response.text
    assert logged_in.world.actions == []


def test_a_model_preview_of_a_checkpoint_shows_the_diff(
    logged_in: Console, tmp_path: Path, monkeypatch
) -> None:
    from dgpp.webui.routes import model_routes

    monkeypatch.setattr(model_routes, "check_model", lambda reference: None)
    response = logged_in.client.post(
        "/models/preview",
        data={"csrf_token": logged_in.csrf(), "model": str(tmp_path / "tiny"), "served_name": "t"},
    )
    assert response.status_code == 200, response.text
    keys = re.findall(r'<td class="key">([^<]+)</td>', response.text)
    assert keys == ["http.served_model_names", "model"]
    assert 'id="apply"' in response.text


def test_switching_to_a_model_that_cannot_load_rolls_back(logged_in: Console) -> None:
    before = logged_in.written()
    logged_in.apply({**DEPLOYMENT, "model": BROKEN_MODEL, "http": {}}, "Switch to broken")
    job = logged_in.wait_for_switch()
    assert job["phase"] == "rolled back", job
    # The reason is rank 0's own last error line; the supervisor's detail stays in the step.
    assert job["reason"] == f"rank 0 failed: ModelLoadError: cannot load the model {BROKEN_MODEL}"
    rolling_back = next(step for step in job["steps"] if step["phase"] == "rolling back")
    assert rolling_back["message"] == (
        f"rank 0 failed (fake): ModelLoadError: cannot load the model {BROKEN_MODEL}; "
        "restoring the previous deployment"
    )
    assert "cannot load the model" in job["log_tail"]
    assert logged_in.world.actions == ["drain", "restart", "restart"]
    assert logged_in.written() == before  # the previous deployment is back
    assert logged_in.world.state == "serving" and logged_in.world.model == "m"
    phases = [step["phase"] for step in job["steps"]]
    assert "rolling back" in phases and phases[-1] == "rolled back"
    page = logged_in.client.get("/switch")
    assert "Why the new deployment was not kept" in page.text
    assert "cannot load the model" in page.text


def test_a_deployment_that_never_gets_ready_rolls_back_after_the_timeout(
    logged_in: Console,
) -> None:
    world = logged_in.world
    world.starting_names.add("slow")
    # With a knob that needs a restart (served names alone are taken live: no restart).
    engine = {**DEPLOYMENT["engine"], "kv_capacity": 4096}
    logged_in.apply({**DEPLOYMENT, "engine": engine, "http": {"served_model_names": ["slow"]}})
    job = logged_in.wait_for_switch()
    assert job["phase"] == "rolled back"
    assert job["reason"] == "not ready within 2 s (starting)"
    assert world.model == "m"


def test_a_restart_the_supervisor_refuses_rolls_back(logged_in: Console) -> None:
    logged_in.world.fail_restart = True
    logged_in.apply({**DEPLOYMENT, "engine": {"kv_capacity": 4096}})
    job = logged_in.wait_for_switch()
    assert job["phase"] == "failed"
    assert job["reason"] == "systemctl restart failed: access denied"
    assert logged_in.written() == DEPLOYMENT


def test_drain_waits_for_running_requests_up_to_its_timeout(logged_in: Console) -> None:
    logged_in.world.running = 2
    logged_in.apply({**DEPLOYMENT, "engine": {"kv_capacity": 4096}})
    job = logged_in.wait_for_switch()
    assert job["phase"] == "ready"
    messages = [step["message"] for step in job["steps"]]
    assert "2 requests still running after 0.5 s; restarting anyway" in messages


def test_an_invalid_deployment_posted_to_switch_is_refused(logged_in: Console) -> None:
    response = logged_in.client.post(
        "/switch",
        data={
            "deployment": json.dumps({"model": "m", "engine": {"kv_capacity": -1}}),
            "csrf_token": logged_in.csrf(),
        },
    )
    assert response.status_code == 400
    assert "engine.kv_capacity" in response.text
    assert logged_in.world.actions == []


def test_one_switch_at_a_time(logged_in: Console) -> None:
    logged_in.world.starting_names.add("m")
    logged_in.apply({**DEPLOYMENT, "engine": {"kv_capacity": 4096}})
    response = logged_in.client.post(
        "/switch",
        data={"deployment": json.dumps(DEPLOYMENT), "csrf_token": logged_in.csrf()},
    )
    assert response.status_code == 409
    assert "another switch is still running" in response.text
    logged_in.wait_for_switch()


def test_a_deployment_file_that_cannot_be_written_undrains_and_fails(
    logged_in: Console, monkeypatch
) -> None:
    from dgpp.webui.app import console_of

    def refuse(raw: dict) -> None:
        raise OSError("Read-only file system")

    monkeypatch.setattr(console_of(logged_in.app).store, "write", refuse)
    logged_in.apply({**DEPLOYMENT, "engine": {"kv_capacity": 4096}})
    job = logged_in.wait_for_switch()
    assert job["phase"] == "failed"
    assert "Read-only file system" in job["steps"][-1]["message"]
    assert logged_in.world.actions == ["drain", "undrain"]


def test_an_unexpected_error_still_ends_the_switch(logged_in: Console, monkeypatch) -> None:
    def broken() -> list:
        raise RuntimeError("supervisor went away")

    logged_in.world.starting_names.add("m")
    from dgpp.webui.app import console_of

    backend = console_of(logged_in.app).backend
    monkeypatch.setattr(backend, "status", broken)
    logged_in.apply({**DEPLOYMENT, "engine": {"kv_capacity": 4096}})
    job = logged_in.wait_for_switch()
    assert job["phase"] == "failed"
    assert job["steps"][-1]["message"] == "internal error: RuntimeError: supervisor went away"
    assert logged_in.client.get("/api/switch").json()["busy"] is False


def test_a_restarted_rank_zero_is_recognised_by_its_instance() -> None:
    from dgpp.webui.switch.switcher import _is_new_process

    # The old process, just started (uptime 0.5 s), is not mistaken for the new one...
    assert not _is_new_process({"instance": "41-1", "uptime_s": 0.5}, "41-1", elapsed=3.0)
    # ...and a new process counts whatever its uptime.
    assert _is_new_process({"instance": "42-2", "uptime_s": 9.0}, "41-1", elapsed=3.0)
    # Engines without an instance: by uptime since the restart, with slack.
    assert _is_new_process({"uptime_s": 1.0}, None, elapsed=3.0)
    assert not _is_new_process({"uptime_s": 60.0}, None, elapsed=3.0)


def test_the_knobs_page_is_grouped_and_a_folded_field_reports_and_opens(
    logged_in: Console,
) -> None:
    from dgpp.engine.configuration.knobs import GROUPS

    page = logged_in.client.get("/knobs")
    assert page.status_code == 200
    legends = re.findall(r"<legend>([^<]+)</legend>", page.text)
    assert legends == list(GROUPS.values())
    # A timeout folded under "advanced": closed until it is the one with the error.
    assert re.search(r'<details class="advanced" id="advanced-timeouts">', page.text)
    response = logged_in.preview_knobs({"timeouts.rendezvous_s": "-1"})
    assert response.status_code == 400
    assert re.search(r'<details class="advanced" id="advanced-timeouts" open>', response.text)
    assert re.search(r'<details class="advanced" id="advanced-scheduling">', response.text)
    assert 'id="error-timeouts.rendezvous_s"' in response.text
