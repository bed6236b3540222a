"""GET /api/doctor: `dgpp doctor`'s findings for the console's node, behind the login. On a
recorded Spark (fake nvidia-smi, a sysfs root) with a head that wants the deployment's API key,
and on this machine itself (no GPU here)."""

from __future__ import annotations

import itertools
import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dgpp.webui.monitor.node_health import NodeDoctor
from dgpp.webui.routes.doctor_routes import get_node_doctor
from tests.appliance.doctor.node import gpu_tools, probe, spark_root
from tests.engine.server.harness import free_port
from tests.webui.conftest import DEPLOYMENT, running_console
from tests.webui.fakes import SELF_CHECK

API_KEY = "head key"


class _Head(BaseHTTPRequestHandler):
    """A head's `GET /v1/metrics` behind its API key, answering the self-check of a fallback."""

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {API_KEY}":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps(SELF_CHECK).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def head() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Head)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _deploy(tmp_path: Path, port: int, key_file: Path | None = None) -> None:
    http = {**DEPLOYMENT["http"], "port": port}
    if key_file is not None:
        key_file.write_text(API_KEY + "\n")
        http["api_key_file"] = str(key_file)
    (tmp_path / "deployment.json").write_text(json.dumps({**DEPLOYMENT, "http": http}))


def test_a_recorded_spark_with_its_head_shows_every_finding(tmp_path: Path, head: int) -> None:
    _deploy(tmp_path, head, tmp_path / "api.key")
    gpu_tools(tmp_path / "bin", "gb10_pd_throttled")
    root = spark_root(tmp_path / "root", "cpufreq_spark_capped.txt")
    doctor = NodeDoctor(probe(root, tmp_path / "bin"), clock=itertools.count().__next__)
    with running_console(tmp_path) as console:
        console.app.dependency_overrides[get_node_doctor] = lambda: doctor
        assert console.client.get("/api/doctor").status_code == 401
        assert console.login().status_code == 303
        report = console.client.get("/api/doctor").json()
        assert (report["status"], report["exit_code"]) == ("fail", 2)
        assert report["hostname"]
        found = {check["name"]: check for check in report["checks"]}
        assert set(found["gpu0.clocks"]) == {"name", "status", "detail", "fix", "label"}
        assert (
            found["gpu0.clocks"]["label"] == "FAIL" and "power-cycle" in found["gpu0.clocks"]["fix"]
        )
        assert found["cpu.frequency_cap"]["label"] == "WARN"
        # The engine check asked the head the console watches, with the deployment's key.
        kernel = found["engine.kernel.paged_attention"]
        assert kernel["status"] == "warn" and "sm_121a" in kernel["detail"]
        # Kept a minute; `fresh` runs the checks again.
        assert console.client.get("/api/doctor").json()["time"] == report["time"]
        assert console.client.get("/api/doctor?fresh=true").json()["time"] > report["time"]


def test_this_machine_reports_without_an_engine(tmp_path: Path) -> None:
    _deploy(tmp_path, free_port())
    with running_console(tmp_path) as console:
        assert console.login().status_code == 303
        report = console.client.get("/api/doctor").json()
    assert report["status"] in ("pass", "warn", "fail") and report["exit_code"] in (0, 1, 2)
    found = {check["name"]: check for check in report["checks"]}
    port = json.loads((tmp_path / "deployment.json").read_text())["http"]["port"]
    assert found["engine"] == {
        "name": "engine",
        "status": "unknown",
        "detail": f"no engine answering at http://127.0.0.1:{port}",
        "fix": "",
        "label": "UNKNOWN",
    }
    if shutil.which("nvidia-smi") is None:
        assert found["gpu"]["status"] == "unknown"
        assert found["gpu"]["detail"].startswith("no GPU")
