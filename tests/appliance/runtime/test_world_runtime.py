"""Multi-rank worlds as users run them: `dgpp serve --world 2` (local process backend) and
`dgpp rank` processes, over gloo and real HTTP on loopback. Ranks are killed and restarted for
real; the world must heal by itself."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.appliance.world_harness import (
    DgppProcess,
    complete,
    greedy_texts,
    http_url,
    rendezvous_port,
    start,
    wait_healthy,
    write_deployment,
)
from tests.conftest import build_tiny_checkpoint
from tests.engine.server.harness import free_port

FAST_TIMEOUTS = {"DGPP_CONSUMER_DEADLINE_S": "10"}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen3")
    return build_tiny_checkpoint(out, tokenizer_dir, "Qwen3ForCausalLM", num_key_value_heads=2)


def _serve(
    checkpoint: Path, world: int, log: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[DgppProcess, str]:
    port = free_port()
    args = ["serve", "--model", str(checkpoint), "--world", str(world), "--port", str(port)]
    args += ["--rendezvous-port", str(free_port()), "--served-model-name", "m"]
    args += ["--kv-capacity", "2048", *extra]
    return start(args, log, {**FAST_TIMEOUTS, **(env or {})}), f"http://127.0.0.1:{port}"


def _world_one_and_two(checkpoint: Path, tmp_path: Path) -> None:
    texts = {}
    for world in (1, 2):
        process, url = _serve(checkpoint, world, tmp_path / f"w{world}.log")
        try:
            health = wait_healthy(url, process)
            assert health["world_size"] == world
            texts[world] = greedy_texts(url)
        finally:
            assert process.stop() == 0, process.text()[-3000:]
    assert texts[2] == texts[1]
    assert all(text.strip() for text in texts[1])


def test_world_two_equals_world_one_tiny_qwen3(qwen3: Path, tmp_path: Path) -> None:
    _world_one_and_two(qwen3, tmp_path)


def test_world_two_equals_world_one_default_model(default_checkpoint: Path, tmp_path: Path) -> None:
    """SmolLM2-135M has 9 query heads: two ranks hold 6 and 3 (whole key/value groups)."""
    _world_one_and_two(default_checkpoint, tmp_path)


def _stream_killing(url: str, victim: int) -> tuple[int, list[str]]:
    """Stream a long completion and SIGKILL `victim` once the first chunk has arrived; returns
    (status, every data line)."""
    body = {"model": "m", "prompt": "Tell me a story", "max_tokens": 400, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    lines: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 1:
                    os.kill(victim, signal.SIGKILL)
        return response.status_code, lines


def test_killed_worker_fails_requests_then_world_heals(qwen3: Path, tmp_path: Path) -> None:
    """Then the restarted worker is frozen (SIGSTOP, never resumed): the local backend's
    watchdog (6 s here, `WatchdogSec=30s` under systemd) kills it and the world heals again."""
    process, url = _serve(qwen3, 2, tmp_path / "serve.log", env={"DGPP_LOCAL_WATCHDOG_S": "6"})
    try:
        wait_healthy(url, process)
        expected = greedy_texts(url)
        (worker,) = process.worker_pids()

        status, lines = _stream_killing(url, worker)
        assert status == 200
        assert lines[-1] == "[DONE]"
        assert json.loads(lines[-2])["error"]["code"] == "engine_failure"
        assert len(lines) < 400  # it ended early, with the error

        # While the world re-forms: 503 with Retry-After, and /health says so.
        response = complete(url, "hello")
        assert response.status_code == 503
        assert response.headers["retry-after"]
        assert response.json()["error"]["code"] in ("world_reforming", "engine_failure")
        health = httpx.get(f"{url}/health", timeout=5)
        if health.status_code == 503:
            assert health.json()["state"] == "re-forming"

        wait_healthy(url, process, timeout=120)
        (restarted,) = process.worker_pids()
        assert restarted != worker
        assert greedy_texts(url) == expected
        log = process.text()
        assert "re-formed" in log

        reformed = log.count("re-formed")
        os.kill(restarted, signal.SIGSTOP)
        deadline = time.monotonic() + 120
        while process.text().count("re-formed") == reformed and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "sent no watchdog ping" in process.text(), process.text()[-3000:]
        assert restarted not in process.worker_pids()
        wait_healthy(url, process, timeout=120)
        assert greedy_texts(url) == expected
    finally:
        assert process.stop() == 0, process.text()[-3000:]


def test_rank0_restart_alone_heals(qwen3: Path, tmp_path: Path) -> None:
    deployment = write_deployment(tmp_path / "d.json", qwen3)
    url = http_url(deployment)
    worker_args = ["rank", "--rank", "1", "--head", "127.0.0.1"]
    worker_args += ["--rendezvous-port", str(rendezvous_port(deployment))]
    worker = start(worker_args, tmp_path / "rank1.log", FAST_TIMEOUTS)
    head = start(["rank", "--rank", "0", "--deployment", str(deployment)], tmp_path / "r0.log")
    try:
        first = wait_healthy(url, head)
        expected = greedy_texts(url)
        head.stop(signal.SIGKILL)
        head = start(["rank", "--rank", "0", "--deployment", str(deployment)], tmp_path / "r0b.log")
        health = wait_healthy(url, head, timeout=120)
        assert health["world_size"] == 2
        # /health names the process (a console waiting for a restart) and the deployment.
        assert health["instance"] != first["instance"]
        assert health["deployment_id"] == first["deployment_id"]
        assert greedy_texts(url) == expected
        assert worker.process.poll() is None  # the same worker process rejoined
        # An orderly stop of rank 0 (systemctl stop / restart) leaves the worker waiting too.
        assert head.stop() == 0
        head = start(["rank", "--rank", "0", "--deployment", str(deployment)], tmp_path / "r0c.log")
        wait_healthy(url, head, timeout=120)
        assert greedy_texts(url) == expected
        assert worker.process.poll() is None
        assert worker.text().count("serving generation") == 3
        # Every rank logs into the deployment's folder, beside the resolved configuration.
        from dgpp.appliance.common.paths import deployment_log_dir
        from dgpp.appliance.deployments.files import deployment_id, resolve

        folder = deployment_log_dir(deployment_id(resolve(deployment)))
        assert sorted(p.name for p in folder.iterdir()) == [
            "deployment.json",
            "rank0.log",
            "rank1.log",
        ]
        assert "rank1 INFO" in (folder / "rank1.log").read_text()
    finally:
        head.stop()
        assert worker.stop() == 0, worker.text()[-3000:]


def test_worker_refuses_a_different_configuration(qwen3: Path, tmp_path: Path) -> None:
    deployment = write_deployment(tmp_path / "d.json", qwen3)
    mine = write_deployment(
        tmp_path / "mine.json",
        qwen3,
        engine={"kv_capacity": 1024},
        rendezvous={"port": rendezvous_port(deployment)},
    )
    head = start(["rank", "--rank", "0", "--deployment", str(deployment)], tmp_path / "r0.log")
    worker = start(["rank", "--rank", "1", "--deployment", str(mine)], tmp_path / "r1.log")
    try:
        assert worker.process.wait(120) == 3, worker.text()
        assert "engine.kv_capacity: this rank has 1024, rank 0 has 2048" in worker.text()
        deadline = time.monotonic() + 30
        while "refused" not in head.text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "rank 1 refused the configuration" in head.text()
        health = httpx.get(f"{http_url(deployment)}/health", timeout=5)
        assert health.status_code == 503
        assert health.headers["retry-after"]
    finally:
        head.stop()


def test_a_step_over_the_watchdog_ends_rank_zero_with_code_4(
    default_checkpoint: Path, tmp_path: Path
) -> None:
    """The step watchdog (here 0.2 s through DGPP_BUS_COMPLETION_TIMEOUT_MS) is the last resort
    for a step that never returns: rank 0 exits with 4 so that its supervisor restarts it."""
    port = free_port()
    args = ["serve", "--model", str(default_checkpoint), "--port", str(port)]
    args += ["--kv-capacity", "8192", "--prefill-chunk-tokens", "8192", "--max-model-len", "8192"]
    args += ["--served-model-name", "m"]
    process = start(args, tmp_path / "serve.log", {"DGPP_BUS_COMPLETION_TIMEOUT_MS": "200"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        body = {"model": "m", "prompt": "word " * 6000, "max_tokens": 1}
        try:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            raise AssertionError(f"the request was answered: {response.status_code}")
        except httpx.HTTPError:
            pass  # the process went away under it
        assert process.process.wait(60) == 4
        assert "timeouts.step_watchdog_s" in process.text()
    finally:
        process.stop()
