"""The Models page and the previews with the memory plan, through the routes on the fake world:
a deployment that does not fit is refused with its numbers before anything restarts (knobs and
models), one that fits shows its plan, the page marks the current model, what is downloaded,
what fits and which switches rename the served model, and pulls run from the page against a
loopback fake hub with progress, cancel and errors."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from dgpp.appliance.models.facts import facts_path
from dgpp.webui.app import console_of
from dgpp.webui.plans.cache import PlanCache
from tests.webui.conftest import Console, running_console
from tests.webui.fake_hub import FakeRepo, allow_downloads, fake_hub

# A CUDA deployment of a model whose facts ship with dgpp (it is not downloaded here): its plan
# is drawn against a DGX Spark, whatever the machine running the tests has.
QWEN3_8B = {
    "model": "Qwen/Qwen3-8B",
    "world_size": 1,
    "engine": {
        "device": "cuda",
        "dtype": "bfloat16",
        "kv_capacity": 65536,
        "max_model_len": 32768,
        "max_concurrency": 16,
        "prefill_chunk_tokens": 2048,
    },
    "http": {"served_model_names": ["m"]},
}
HUGE_KV = str(10**11)


def field_errors(html: str) -> dict[str, str]:
    return dict(re.findall(r'id="error-([^"]+)">([^<]+)<', html))


def row_of(html: str, key: str) -> dict[str, str]:
    """The data-* attributes of the Models page's row `key` (`template:NAME`)."""
    match = re.search(rf'<tr ([^>]*data-candidate="{re.escape(key)}"[^>]*)>', html)
    assert match is not None, f"no row {key}"
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', match.group(1)))


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This machine's checkpoints: an empty hub cache and dgpp home of the test's own."""
    return allow_downloads(tmp_path, monkeypatch)


@contextmanager
def console_with(tmp_path: Path, deployment: dict[str, Any]) -> Iterator[Console]:
    """A logged-in console whose deployment file is `deployment`, planning against a Spark."""
    (tmp_path / "deployment.json").write_text(json.dumps(deployment))
    with running_console(tmp_path) as console:
        console_of(console.app).plans = PlanCache(gpu=lambda index: None)
        assert console.login().status_code == 303
        yield console


def add_to_hf_cache(cache: Path, repo_id: str, config: Path) -> Path:
    """`config` as the config.json of a snapshot of `repo_id` in the hub cache's own layout."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    blob = repo / "blobs" / hashlib.sha256(config.read_bytes()).hexdigest()
    blob.parent.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    shutil.copyfile(config, blob)
    (snapshot / "config.json").symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_knob_preview_refuses_a_kv_pool_that_does_not_fit(machine, tmp_path) -> None:
    with console_with(tmp_path, QWEN3_8B) as console:
        before = console.config.deployment.read_text()
        response = console.preview_knobs({"engine.kv_capacity": HUGE_KV})
        assert response.status_code == 400
        error = field_errors(response.text)["engine.kv_capacity"]
        assert error.startswith(
            "the memory plan refuses it: does not fit on DGX Spark (128 GB unified) (world 1): "
            "rank 0: weights 15.26 GiB + KV "
        )
        assert "(100,000,000,000 tokens)" in error
        assert "at most about " in error and " KV tokens would fit" in error
        assert 'id="plan-refusal"' in response.text
        assert '<tr data-rank="0" data-fits="false" class="unfit">' in response.text
        assert 'id="apply"' not in response.text
        assert console.world.actions == []
        assert console.config.deployment.read_text() == before


def test_a_switch_posted_without_a_preview_is_refused_by_the_memory_plan(machine, tmp_path) -> None:
    with console_with(tmp_path, QWEN3_8B) as console:
        before = console.config.deployment.read_text()
        huge = {**QWEN3_8B, "engine": {**QWEN3_8B["engine"], "kv_capacity": 10**11}}
        response = console.client.post(
            "/switch",
            data={"deployment": json.dumps(huge), "title": "t", "csrf_token": console.csrf()},
            follow_redirects=False,
        )
        assert response.status_code == 400
        assert "the memory plan refuses it: does not fit on DGX Spark" in response.text
        assert console.world.actions == []
        assert console.config.deployment.read_text() == before


def test_every_stage_of_a_knob_form_reports_in_one_pass(machine, tmp_path) -> None:
    with console_with(tmp_path, QWEN3_8B) as console:
        response = console.preview_knobs(
            {
                "engine.prefill_precision": "fp8",  # does not convert
                "http.queue_limit": "-1",  # the schema refuses it
                "timeouts.heartbeat_s": "100",  # the runtime's rule across two timeouts
                "timeouts.control_deadline_s": "120",
                "engine.kv_capacity": HUGE_KV,  # the memory plan refuses it
            }
        )
        assert response.status_code == 400
        errors = field_errors(response.text)
        assert sorted(errors) == [
            "engine.kv_capacity",
            "engine.prefill_precision",
            "http.queue_limit",
            "timeouts.heartbeat_s",
        ]
        assert errors["engine.kv_capacity"].startswith("the memory plan refuses it: does not fit")
        assert console.world.actions == []


def test_a_knob_preview_shows_the_plan_of_a_deployment_that_fits(machine, tmp_path) -> None:
    with console_with(tmp_path, QWEN3_8B) as console:
        response = console.preview_knobs({"engine.kv_capacity": "131072"})
        assert response.status_code == 200, response.text
        verdict = re.search(r'id="plan-verdict">([^<]+)<', response.text)
        assert verdict is not None
        assert verdict.group(1) == (
            "fits on DGX Spark (128 GB unified): 131,072 KV tokens per rank; the largest "
            "context one request can have is 40,960 tokens"
        )
        assert '<tr data-rank="0" data-fits="true">' in response.text
        assert "<td>15.26 GiB</td>" in response.text  # Qwen3-8B's weights in bfloat16
        assert 'id="apply"' in response.text


def test_without_a_plan_the_preview_says_so_and_allows_the_switch(console_logged) -> None:
    response = console_logged.preview_knobs({"engine.kv_capacity": "4096"})
    assert response.status_code == 200, response.text
    unavailable = re.search(r'id="plan-unavailable">([^<]+)<', response.text)
    assert unavailable is not None
    assert unavailable.group(1).startswith(
        "no memory plan: the checkpoint is not on this machine and no facts about it ship"
    )
    assert "the switch is allowed" in unavailable.group(1)
    assert 'id="apply"' in response.text


@pytest.fixture
def console_logged(machine, tmp_path) -> Iterator[Console]:
    """The default fake deployment (/models/small, on no machine) on an empty machine."""
    with running_console(tmp_path) as console:
        assert console.login().status_code == 303
        yield console


def test_a_model_preview_refuses_a_checkpoint_too_big_for_the_world(machine, tmp_path) -> None:
    big = tmp_path / "Qwen2.5-72B-Instruct"
    big.mkdir()
    shutil.copyfile(facts_path("Qwen/Qwen2.5-72B-Instruct"), big / "config.json")
    with console_with(tmp_path, QWEN3_8B) as console:
        response = console.client.post(
            "/models/preview",
            data={"csrf_token": console.csrf(), "model": str(big), "served_name": "big"},
        )
        assert response.status_code == 400
        refusal = re.search(r'id="plan-refusal" role="alert">([^<]+)<', response.text)
        assert refusal is not None
        assert refusal.group(1).startswith(
            "Refused before anything is restarted: does not fit on DGX Spark (128 GB unified) "
            "(world 1): rank 0: weights 135."
        )
        assert "not even the weights, workspace and states fit without any KV pool" in (
            refusal.group(1)
        )
        assert '<td class="key">model</td>' in response.text  # what would have changed
        assert 'id="apply"' not in response.text
        assert console.world.actions == []


def test_a_model_preview_that_fits_shows_its_plan(machine, tmp_path) -> None:
    small = tmp_path / "Qwen3-8B"
    small.mkdir()
    shutil.copyfile(facts_path("Qwen/Qwen3-8B"), small / "config.json")
    with console_with(tmp_path, {**QWEN3_8B, "model": "/models/other"}) as console:
        response = console.client.post(
            "/models/preview",
            data={"csrf_token": console.csrf(), "model": str(small), "served_name": "small"},
        )
        assert response.status_code == 200, response.text
        assert 'id="plan-verdict">fits on DGX Spark' in response.text
        assert "from its checkpoint" in response.text
        assert 'id="apply"' in response.text


def wait_for_fits(console: Console, keys: list[str], timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = console.client.get("/api/models/fits", params={"rows": ",".join(keys)}).json()
        if all(body["rows"][key]["fits"] != "checking" for key in keys):
            return body["rows"]
        time.sleep(0.1)
    raise AssertionError(f"still checking: {body}")


def test_the_models_page_marks_current_downloaded_fits_and_renames(machine, tmp_path) -> None:
    add_to_hf_cache(machine, "Qwen/Qwen3-8B", facts_path("Qwen/Qwen3-8B"))
    site = {"template": "qwen3-8b_bfloat16_w1", "world_size": 1}
    with console_with(tmp_path, site) as console:
        page = console.client.get("/models").text
        current = row_of(page, "template:qwen3-8b_bfloat16_w1")
        assert current["current"] == "true"
        assert 'id="current-template-qwen3-8b_bfloat16_w1">current<' in page
        assert row_of(page, "template:qwen3-8b_bfloat16_w2")["current"] == "false"
        # Qwen3-8B is in the hub cache: its templates can be previewed; Llama is not: download.
        assert current["downloaded"] == "true"
        assert 'id="preview-template-qwen3-8b_bfloat16_w2"' in page
        llama = row_of(page, "template:llama-3.1-8b-instruct_bfloat16_w1")
        assert llama["downloaded"] == "false"
        assert 'id="download-template-llama-3.1-8b-instruct_bfloat16_w1"' in page
        assert 'value="meta-llama/Llama-3.1-8B-Instruct"' in page
        assert 'id="preview-template-llama-3.1-8b-instruct_bfloat16_w1"' not in page
        # Switching to Llama changes the name clients use; another Qwen3-8B world does not.
        assert llama["renames"] == "true"
        assert (
            'id="renames-template-llama-3.1-8b-instruct_bfloat16_w1" title="clients now ask for '
            'qwen3-8b; after this switch the model answers to llama-3.1-8b-instruct">new names<'
        ) in page
        assert row_of(page, "template:qwen3-8b_bfloat16_w2")["renames"] == "false"
        # The consequence is said once, above the tables, not on every row.
        assert page.count('id="served-notice"') == 1
        assert "Clients now ask for <strong>qwen3-8b</strong>" in page
        assert page.count("after this switch the model answers") == page.count('title="clients')
        # The plans are computed in the background; the page shows them once known. This site
        # keeps world 1, so the 72B template would run on one Spark: it does not fit.
        assert current["fits"] == "checking"
        keys = ["template:qwen3-8b_bfloat16_w1", "template:qwen2.5-72b-instruct_bfloat16_w2"]
        fits = wait_for_fits(console, keys)
        assert fits[keys[0]]["fits"] == "fits"
        assert fits[keys[0]]["text"] == "fits; up to 40,960 tokens per request"
        assert fits[keys[1]]["fits"] == "refused"
        assert fits[keys[1]]["summary"].startswith("does not fit on DGX Spark")
        assert fits[keys[1]]["size"].endswith(" GiB per rank")  # the plan's weights
        assert fits[keys[1]]["quantization"] == "none"
        page = console.client.get("/models").text
        assert row_of(page, keys[0])["fits"] == "fits"
        assert row_of(page, keys[1])["fits"] == "refused"
        assert row_of(page, "template:llama-3.1-8b-instruct_bfloat16_w1")["fits"] == "checking"


def wait_for_pull(console: Console, repo: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = {
            job["repo_id"]: job for job in console.client.get("/api/models/pulls").json()["pulls"]
        }
        if repo in jobs and not jobs[repo]["running"]:
            return jobs[repo]
        time.sleep(0.05)
    raise AssertionError(f"the pull of {repo} did not end: {jobs}")


def slow_repo(repo_id: str) -> FakeRepo:
    weights = bytes(range(256)) * (1 << 14)  # 4 MiB, 20 ms per 64 KiB: about 1.3 s
    files = {"config.json": facts_path("Qwen/Qwen3-8B").read_bytes(), "model.safetensors": weights}
    return FakeRepo(repo_id, files, slow={"model.safetensors": 0.02})


def test_a_pull_from_the_page_shows_progress_and_cancels(machine, tmp_path, monkeypatch) -> None:
    with fake_hub(slow_repo("org/tiny")) as hub, console_with(tmp_path, QWEN3_8B) as console:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        response = console.client.post(
            "/models/pull",
            data={"csrf_token": console.csrf(), "repo": "org/tiny"},
            follow_redirects=False,
        )
        assert response.status_code == 303
        assert response.headers["location"] == "/models#downloads"
        # One pull per repo at a time.
        again = console.client.post(
            "/models/pull", data={"csrf_token": console.csrf(), "repo": "org/tiny"}
        )
        assert again.status_code == 409
        assert "org/tiny is already being pulled" in again.text
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            job = console.client.get("/api/models/pulls").json()["pulls"][0]
            if 0 < job["bytes_done"] < job["bytes_total"]:
                break
            time.sleep(0.02)
        assert job["phase"] == "downloading" and job["running"], job
        page = console.client.get("/models").text
        assert '<tr id="pull-org--tiny" data-repo="org/tiny" data-phase="downloading"' in page
        assert 'id="pull-progress-org--tiny"' in page
        assert 'id="pull-cancel-org--tiny"' in page
        cancel = console.client.post(
            "/models/pull/cancel",
            data={"csrf_token": console.csrf(), "repo": "org/tiny"},
            follow_redirects=False,
        )
        assert cancel.status_code == 303
        job = wait_for_pull(console, "org/tiny")
        assert job["phase"] == "cancelled"
        assert job["bytes_done"] < job["bytes_total"]
        page = console.client.get("/models").text
        assert 'data-candidate="checkpoint:org/tiny"' not in page  # nothing half-installed
        assert 'id="pull-status-org--tiny" class="pull-status">cancelled' in page


def test_a_pull_into_the_weights_directory_is_offered_for_switching(
    machine, tmp_path, monkeypatch
) -> None:
    weights = tmp_path / "nfs"
    weights.mkdir()
    site = {**QWEN3_8B, "paths": {"models_dir": str(weights)}}
    with fake_hub(slow_repo("org/tiny")) as hub, console_with(tmp_path, site) as console:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert f"Pulled with huggingface_hub into {weights}," in console.client.get("/models").text
        console.client.post("/models/pull", data={"csrf_token": console.csrf(), "repo": "org/tiny"})
        job = wait_for_pull(console, "org/tiny")
        assert job["phase"] == "done", job
        assert job["message"] == str(weights / "tiny")
        page = console.client.get("/models").text
        row = row_of(page, "checkpoint:tiny")
        assert row["downloaded"] == "true"
        assert "<td>weights dir</td>" in page


def test_pull_errors_are_shown_with_their_message(machine, tmp_path, monkeypatch) -> None:
    with fake_hub() as hub, console_with(tmp_path, QWEN3_8B) as console:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        response = console.client.post(
            "/models/pull", data={"csrf_token": console.csrf(), "repo": "not a repo"}
        )
        assert response.status_code == 400
        assert "&#39;not a repo&#39; is not a Hugging Face repo id" in response.text
        console.client.post(
            "/models/pull", data={"csrf_token": console.csrf(), "repo": "org/missing"}
        )
        job = wait_for_pull(console, "org/missing")
        assert job["phase"] == "failed"
        assert job["message"].startswith("org/missing was not found on the Hugging Face hub")
        page = console.client.get("/models").text
        assert (
            'id="pull-status-org--missing" class="pull-status">failed: org/missing was not found'
            in page
        )
        response = console.client.post(
            "/models/pull/cancel", data={"csrf_token": console.csrf(), "repo": "org/missing"}
        )
        assert response.status_code == 409
        assert "no pull of org/missing is running" in response.text


def test_a_download_that_stopped_partway_is_not_offered(machine, tmp_path, monkeypatch) -> None:
    """A console killed in the middle of a pull (no cleanup ran) leaves a snapshot holding
    config.json but not the weights: the page names it as partly downloaded, no switch to it."""
    with fake_hub(slow_repo("org/tiny")) as hub, console_with(tmp_path, QWEN3_8B) as console:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        console.client.post("/models/pull", data={"csrf_token": console.csrf(), "repo": "org/tiny"})
        assert wait_for_pull(console, "org/tiny")["phase"] == "done"
        assert 'data-candidate="checkpoint:org/tiny"' in console.client.get("/models").text
        (snapshot,) = (machine / "models--org--tiny" / "snapshots").iterdir()
        (snapshot / "model.safetensors").unlink()
        page = console.client.get("/models").text
        assert 'data-candidate="checkpoint:org/tiny"' not in page
        assert 'id="incomplete-downloads">Partly downloaded (not offered): org/tiny;' in page
