"""How fast a world heals: `dgpp serve --world 2` on the default model, SIGKILL the worker rank,
and time its restart (by the local backend) and the first successful completion afterwards.

    .venv/bin/python bench/heal.py [--model default] [--repeats 3]

Target (tensor-parallel issue): the healed world serves again within (warm start + 5 s) of the
dead rank's restart; the warm start of a rank is printed by bench/startup.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_pid(process: subprocess.Popen[bytes]) -> int | None:
    """The live `dgpp rank` child (a killed one lingers as a zombie until reaped)."""
    for child in psutil.Process(process.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "rank" in child.cmdline():
                return child.pid
        except psutil.Error:
            continue
    return None


def completes(url: str) -> bool:
    body = {"model": "m", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    try:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def wait(predicate: object, timeout: float = 300.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return time.monotonic()
        time.sleep(0.02)
    raise TimeoutError("gave up waiting")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "dgpp.appliance.cli", "serve", "--model", args.model]
    command += ["--world", "2", "--port", str(port), "--rendezvous-port", str(free_port())]
    command += ["--served-model-name", "m", "--kv-capacity", "4096"]
    resident = tempfile.mkdtemp(prefix="dgpp-heal-")
    env = {**os.environ, "DGPP_RESIDENT_DIR": resident}
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait(lambda: completes(url))
            for attempt in range(args.repeats):
                victim = worker_pid(process)
                assert victim is not None
                killed = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                restarted = wait(lambda v=victim: worker_pid(process) not in (None, v))
                healed = wait(lambda: completes(url))
                print(
                    f"run {attempt + 1}: worker restarted {restarted - killed:.2f} s after the "
                    f"kill; serving again {healed - restarted:.2f} s after the restart "
                    f"({healed - killed:.2f} s after the kill)"
                )
        finally:
            process.terminate()
            process.wait(60)
        log.seek(0)
        for line in log.read().decode().splitlines():
            if "re-formed" in line or "ready in" in line:
                print("  log:", line.split(": ", 1)[-1])


if __name__ == "__main__":
    main()
