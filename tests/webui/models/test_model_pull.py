"""Pulls started from the console, against a loopback fake of the Hugging Face hub: progress in
bytes while the files arrive, a cancel that stops the download in the middle and leaves nothing
listed as installed, the NFS weights directory as a target, and errors with their message."""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest

from dgpp.appliance.models.store import list_models, resolve_model
from dgpp.engine.errors import ModelLoadError
from dgpp.webui.models.pull import PullBusyError, PullJob, PullManager, PullRefusedError
from tests.webui.fake_hub import FakeRepo, allow_downloads, fake_hub

REPO_ID = "org/tiny"
CONFIG = b'{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}'
WEIGHTS = 4 << 20  # served in 64 KiB chunks, 20 ms apart: about 1.3 s


def tiny_repo(weights: int = WEIGHTS, delay: float = 0.02) -> FakeRepo:
    files = {
        "config.json": CONFIG,
        "tokenizer.json": b"{}",
        "model.safetensors": bytes(range(256)) * (weights // 256),
    }
    return FakeRepo(REPO_ID, files, slow={"model.safetensors": delay})


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return allow_downloads(tmp_path, monkeypatch)


@pytest.fixture
def hub(online: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    with fake_hub(tiny_repo()) as running:
        monkeypatch.setenv("HF_ENDPOINT", running.url)
        yield running


def wait(job: PullJob, timeout: float = 30.0) -> PullJob:
    deadline = time.monotonic() + timeout
    while job.is_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not job.is_running, job.as_json()
    return job


def wait_for_bytes(job: PullJob, timeout: float = 20.0) -> tuple[int, int]:
    """The first progress seen partway: some bytes, not all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, total = job.bytes()
        if 0 < done < total:
            return done, total
        assert job.is_running, job.as_json()
        time.sleep(0.01)
    raise AssertionError(f"no progress: {job.as_json()}")


def test_a_pull_reports_its_bytes_and_installs_the_checkpoint(hub) -> None:
    manager = PullManager()
    job = manager.start(REPO_ID, None)
    _, total = wait_for_bytes(job)
    assert total == len(CONFIG) + 2 + WEIGHTS  # every file, known before they all arrive
    assert job.as_json()["phase"] == "downloading"
    wait(job)
    assert job.phase == "done", job.message
    assert job.bytes() == (total, total)
    assert job.files() == (3, 3)
    snapshot = resolve_model(REPO_ID)  # offline, from the cache
    assert job.message == str(snapshot)
    assert (snapshot / "model.safetensors").stat().st_size == WEIGHTS
    assert [entry.name for entry in list_models()] == [REPO_ID]
    assert any(request.startswith("GET /api/models/org/tiny/revision/") for request in hub.requests)


def test_one_pull_per_repo_at_a_time(hub) -> None:
    manager = PullManager()
    job = manager.start(REPO_ID, None)
    with pytest.raises(PullBusyError, match="already being pulled"):
        manager.start(REPO_ID, None)
    wait(job)
    assert wait(manager.start(REPO_ID, None)).phase == "done"  # again, once it is over
    with pytest.raises(PullRefusedError, match="not a Hugging Face repo id"):
        manager.start("../../etc", None)


def test_cancel_stops_the_download_and_leaves_nothing_installed(online, monkeypatch) -> None:
    with fake_hub(tiny_repo(weights=16 << 20, delay=0.02)) as hub:  # about 5 s in all
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        manager = PullManager()
        job = manager.start(REPO_ID, None)
        _, total = wait_for_bytes(job)
        assert manager.cancel(REPO_ID) is job
        assert job.as_json()["phase"] == "cancelling"
        wait(job, timeout=5)
        assert job.phase == "cancelled", job.message
        assert job.bytes()[0] < total  # it stopped partway...
        assert hub.aborted.wait(5)  # ...and the hub saw the download go away
    assert list_models() == []
    with pytest.raises(ModelLoadError, match="not downloaded"):
        resolve_model(REPO_ID)
    assert not (online / "models--org--tiny").exists()
    assert manager.cancel(REPO_ID) is None  # nothing running any more


def test_a_cancelled_pull_keeps_the_revision_that_was_there(hub, online) -> None:
    manager = PullManager()
    assert wait(manager.start(REPO_ID, None)).phase == "done"
    before = resolve_model(REPO_ID)
    repo = hub.repos[REPO_ID]
    repo.commit = "f" * 40  # a new revision on the hub, with other weights
    repo.files["model.safetensors"] = bytes(reversed(repo.files["model.safetensors"]))
    job = manager.start(REPO_ID, None)
    wait_for_bytes(job)
    manager.cancel(REPO_ID)
    assert wait(job).phase == "cancelled"
    assert resolve_model(REPO_ID) == before  # main names the old revision again
    assert [entry.path for entry in list_models()] == [before]
    assert not list((online / "models--org--tiny" / "blobs").glob("*.incomplete"))


def test_a_pull_into_the_weights_directory_appears_whole(hub, tmp_path) -> None:
    weights = tmp_path / "nfs" / "models"
    weights.mkdir(parents=True)
    manager = PullManager()
    job = manager.start(REPO_ID, weights)
    wait_for_bytes(job)
    assert not (weights / "tiny").exists()  # nothing under its name until it is complete
    assert (weights / ".tiny.partial").is_dir()
    wait(job)
    assert job.phase == "done", job.message
    assert job.message == str(weights / "tiny")
    assert (weights / "tiny" / "config.json").read_bytes() == CONFIG
    assert not (weights / ".tiny.partial").exists()
    with pytest.raises(PullRefusedError, match="already exists"):
        manager.start(REPO_ID, weights)


def test_a_cancelled_pull_into_the_weights_directory_leaves_nothing(hub, tmp_path) -> None:
    weights = tmp_path / "models"
    weights.mkdir()
    manager = PullManager()
    job = manager.start(REPO_ID, weights)
    wait_for_bytes(job)
    manager.cancel(REPO_ID)
    assert wait(job).phase == "cancelled"
    assert list(weights.iterdir()) == []


def test_an_unknown_repo_fails_with_the_hubs_answer(hub) -> None:
    job = wait(PullManager().start("org/missing", None))
    assert job.phase == "failed"
    assert job.message.startswith("org/missing was not found on the Hugging Face hub")
    assert list_models() == []


def test_no_network_fails_with_its_message(online, monkeypatch) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    job = wait(PullManager().start(REPO_ID, None))
    assert job.phase == "failed"
    assert job.message.startswith("cannot download org/tiny: the hub could not be reached")


def test_a_full_disk_fails_with_its_message(hub, monkeypatch) -> None:
    def full(*args: object, **kwargs: object) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    job = wait(PullManager().start(REPO_ID, None))
    assert job.phase == "failed"
    assert job.message == "downloading org/tiny failed: [Errno 28] No space left on device"


def test_an_offline_console_says_so(hub, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    job = wait(PullManager().start(REPO_ID, None))
    assert job.phase == "failed"
    assert "HF_HUB_OFFLINE is set" in job.message
