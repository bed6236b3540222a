"""Real `dgpp` processes (serve / rank) on loopback, for the multi-rank runtime tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.engine.server.harness import free_port

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]


@dataclass
class DgppProcess:
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"pid {self.pid} ignored {sig}:\n{self.text()[-3000:]}") from None

    def worker_pids(self) -> list[int]:
        """The `dgpp rank` children of a `dgpp serve --world N` process."""
        pids = []
        for child in psutil.Process(self.pid).children():
            try:  # a killed worker lingers as a zombie until the backend reaps it
                if child.status() != psutil.STATUS_ZOMBIE and "rank" in child.cmdline():
                    pids.append(child.pid)
            except psutil.Error:
                continue
        return sorted(pids)


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> DgppProcess:
    handle = log.open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "dgpp.appliance.cli", *args],
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**os.environ, "GOMP_SPINCOUNT": "0", **(env or {})},
    )
    return DgppProcess(process, log)


def wait_healthy(url: str, process: DgppProcess, timeout: float = 240.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.process.poll() is not None:
            raise AssertionError(f"exited with {process.process.returncode}:\n{process.text()}")
        try:
            response = httpx.get(f"{url}/health", timeout=5)
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not healthy after {timeout} s:\n{process.text()[-5000:]}")


def complete(url: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def greedy_texts(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        response = complete(url, prompt)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def write_deployment(path: Path, checkpoint: Path, **sections: Any) -> Path:
    raw: dict[str, Any] = {
        "model": str(checkpoint),
        "world_size": 2,
        "engine": {"kv_capacity": 2048, "num_threads": 1},
        "http": {"port": free_port(), "served_model_names": ["m"]},
        "rendezvous": {"port": free_port()},
        "timeouts": {"heartbeat_s": 1.0, "control_deadline_s": 10.0, "rendezvous_s": 60.0},
    }
    for name, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(name, {}).update(value)
        else:
            raw[name] = value
    path.write_text(json.dumps(raw))
    return path


def http_url(deployment: Path) -> str:
    return f"http://127.0.0.1:{json.loads(deployment.read_text())['http']['port']}"


def rendezvous_port(deployment: Path) -> int:
    return int(json.loads(deployment.read_text())["rendezvous"]["port"])
