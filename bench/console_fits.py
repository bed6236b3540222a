"""How long the console's Models page takes to a complete fit column (issue 45), and how long
SIGTERM takes to end the console after it.

    .venv/bin/python bench/console_fits.py STATE_DIR [--port 18201] [--runs 2]

Starts `dgpp webui --backend local --no-autostart` on STATE_DIR (a login is set first if there
is none), opens the Models page as soon as the console answers, polls `/api/models/fits` (as the
page does) until no row pends, then sends SIGTERM. Run it twice on the same STATE_DIR to see a
console started again on stored plans; on a fresh directory for the first start ever.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

PASSWORD = "bench console password"


def dgpp(*args: str) -> list[str]:
    return [sys.executable, "-m", "dgpp.appliance.cli", "webui", *args]


def run(state: Path, port: int) -> None:
    env = {key: value for key, value in os.environ.items() if key != "DGPP_WEBUI_CONFIG"}
    flags = ["--backend", "local", "--state-dir", str(state)]
    if not (state / "webui.credentials").exists():
        setting = dgpp("set-password", *flags, "--password-stdin")
        subprocess.run(setting, input=f"{PASSWORD}\n".encode(), env=env, check=True)
    started = time.monotonic()
    console = dgpp(*flags, "--no-autostart", "--port", str(port))
    process = subprocess.Popen(console, env=env, stderr=subprocess.DEVNULL)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        while True:
            try:
                page = client.get("/login")
                break
            except httpx.TransportError:
                time.sleep(0.1)
        token = re.search(r'name="csrf_token" value="([^"]*)"', page.text)
        assert token is not None
        login = {"username": "admin", "password": PASSWORD, "csrf_token": token.group(1)}
        client.post("/login", data=login)
        opened = time.monotonic()
        checking = client.get("/models").text.count('data-fits="checking"')
        while client.get("/api/models/fits").json()["pending"]:
            time.sleep(0.5)
        complete = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
        stopped = time.monotonic()
    finally:
        client.close()
        process.kill()
    print(
        f"page opened {opened - started:.1f} s after start with {checking} rows checking; "
        f"column complete {complete - opened:.1f} s after; SIGTERM: exit {code} in "
        f"{stopped - complete:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("state", type=Path)
    parser.add_argument("--port", type=int, default=18201)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    args.state.mkdir(parents=True, exist_ok=True)
    for _ in range(args.runs):
        run(args.state, args.port)


if __name__ == "__main__":
    main()
