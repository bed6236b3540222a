"""The engine's self-report, read from a stub head on a loopback socket that answers
`GET /v1/metrics` as the engine does (JSON behind a Bearer key)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpp.appliance.doctor.engine_state import (
    DEFAULT_PORT,
    _allreduce,
    _kernels,
    default_url,
    engine_checks,
    link_gbps,
)
from dgpp.appliance.doctor.probe import Probe

KEY = "sk-doctor"


class StubHead:
    """A head whose /v1/metrics body is `body` (bytes as given, else JSON)."""

    def __init__(self) -> None:
        self.body: Any = {}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    self.send_response(401)
                    self.end_headers()
                    return
                data = stub.body if isinstance(stub.body, bytes) else json.dumps(stub.body).encode()
                self.send_response(200 if self.path == "/v1/metrics" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture(scope="module")
def head() -> Iterator[StubHead]:
    stub = StubHead()
    thread = threading.Thread(target=stub.server.serve_forever, daemon=True)
    thread.start()
    yield stub
    stub.server.shutdown()
    stub.server.server_close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_kernel_that_fell_back_warns_with_its_reason(head: StubHead) -> None:
    head.body = {
        "kernels": {
            "rms_norm": "ok",
            "paged_attention": "fallback: out of resources: shared memory",
        },
    }
    (check,) = engine_checks(head.url, KEY)
    assert (check.name, check.status) == ("engine.kernel.paged_attention", "warn")
    assert check.detail == "paged_attention: fallback: out of resources: shared memory"
    assert check.fix.startswith("a Triton kernel fell back to its PyTorch twin: correct tokens")


def test_all_kernels_ok_passes_and_an_older_engine_is_unknown(head: StubHead) -> None:
    head.body = {"kernels": {"rms_norm": "ok", "fused_moe": "ok"}}
    assert [(c.status, c.detail) for c in engine_checks(head.url, KEY)] == [
        ("pass", "2 Triton kernels passed")
    ]
    head.body = {"requests": 3}
    (check,) = engine_checks(head.url, KEY)
    assert check.status == "unknown" and "no kernel self-check" in check.detail


def test_allreduce_below_half_the_link_warns(head: StubHead) -> None:
    runs = [
        {"bytes": 1 << 20, "seconds": 0.001, "bus_gbps": 30.0},
        {"bytes": 1 << 28, "seconds": 0.03, "bus_gbps": 90.0},
    ]
    head.body = {"kernels": {}, "allreduce": runs}
    allreduce = engine_checks(head.url, KEY, link_gbps=200.0)[-1]
    assert (allreduce.name, allreduce.status) == ("engine.allreduce", "warn")
    assert "90.0 Gb/s (at 268435456 bytes): 45% of the link's 200 Gb/s" in allreduce.detail
    assert engine_checks(head.url, KEY, link_gbps=160.0)[-1].status == "pass"
    assert "rate is unknown" in engine_checks(head.url, KEY)[-1].detail


def test_a_wrong_key_garbage_and_no_engine_are_unknown(head: StubHead) -> None:
    head.body = {"kernels": {}}
    (check,) = engine_checks(head.url, "wrong")
    assert check.status == "unknown" and "HTTP 401 (give --api-key or DGPP_API_KEY)" in check.detail
    head.body = b"<html>not json"
    (check,) = engine_checks(head.url, KEY)
    assert check.status == "unknown" and "no JSON" in check.detail
    head.body = [1, 2]
    assert engine_checks(head.url, KEY)[0].status == "unknown"
    url = f"http://127.0.0.1:{free_port()}"
    assert [(c.status, c.detail) for c in engine_checks(url, KEY)] == [
        ("unknown", f"no engine answering at {url}")
    ]


def test_the_url_comes_from_the_deployment(tmp_path: Path) -> None:
    assert default_url(Probe(tmp_path)) == f"http://127.0.0.1:{DEFAULT_PORT}"
    (tmp_path / "etc" / "dgpp").mkdir(parents=True)
    (tmp_path / "etc" / "dgpp" / "deployment.json").write_text('{"http": {"port": 8000}}')
    assert default_url(Probe(tmp_path)) == "http://127.0.0.1:8000"
    (tmp_path / "etc" / "dgpp" / "deployment.json").write_text("{not json")
    assert default_url(Probe(tmp_path)) == f"http://127.0.0.1:{DEFAULT_PORT}"


def test_the_link_rate_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "sys/class/net/enp1s0f0np0").mkdir(parents=True)
    (tmp_path / "sys/class/net/enp1s0f0np0/speed").write_text("200000\n")
    assert link_gbps(Probe(tmp_path), "enp1s0f0np0") == 200.0
    (tmp_path / "sys/class/net/enp1s0f0np0/speed").write_text("-1\n")  # link down
    assert link_gbps(Probe(tmp_path), "enp1s0f0np0") is None
    assert link_gbps(Probe(tmp_path), None) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(JSON, st.one_of(st.none(), st.floats(min_value=1, max_value=800)))
def test_any_json_gives_findings_not_exceptions(body: object, rate: float | None) -> None:
    for check in [*_kernels(body), _allreduce(body, rate)]:
        assert check.status in ("pass", "warn", "unknown")
