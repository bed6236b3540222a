"""Rank 0's access log: monitoring polls at DEBUG, everything else at INFO, every line stamped.
For real, a `dgpp serve` process on a tiny checkpoint; and the filter on uvicorn's own records."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest

from dgpp.appliance.runtime.http_access_log import (
    ACCESS_LOGGER,
    MonitoringPollFilter,
    is_monitoring_poll,
)
from tests.appliance.world_harness import complete, start, wait_healthy
from tests.conftest import build_tiny_checkpoint
from tests.engine.server.harness import free_port

# 2026-12-01T10:00:00.123+01:00 rank0 INFO name: message
STAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d rank0 [A-Z]+ \S+: ")
POLLS = ("/health", "/health?verbose=1", "/v1/metrics", "/metrics", "/v1/models", "/admin/nodes")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen3")
    return build_tiny_checkpoint(out, tokenizer_dir, "Qwen3ForCausalLM", num_key_value_heads=2)


def test_serve_logs_requests_but_not_the_polls(qwen3: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", str(qwen3), "--port", str(port), "--served-model-name", "m"]
    args += ["--kv-capacity", "2048", "--log-level", "info"]
    process = start(args, tmp_path / "serve.out", {"DGPP_LOG_DIR": str(tmp_path / "logs")})
    try:
        wait_healthy(url, process)
        for path in POLLS:
            assert httpx.get(url + path, timeout=30).status_code == 200, path
        assert complete(url, "Hello", max_tokens=2).status_code == 200
        assert httpx.get(f"{url}/no-such-path", timeout=30).status_code == 404
        assert httpx.get(f"{url}/v1/models/no-such-model", timeout=30).status_code == 404
    finally:
        assert process.stop() == 0, process.text()[-3000:]
    (rank_log,) = (tmp_path / "logs").glob("deployments/*/rank0.log")
    for text in (process.text(), rank_log.read_text()):
        access = [line for line in text.splitlines() if "uvicorn.access" in line]
        assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in access), text
        assert any('"GET /no-such-path HTTP/1.1" 404' in line for line in access), text
        assert any('"GET /v1/models/no-such-model HTTP/1.1" 404' in line for line in access)
        for path in POLLS:
            assert not any(f'"GET {path} HTTP/1.1" 200' in line for line in access), path
        assert not any('"GET /health HTTP/1.1" 503' in line for line in access), text
        # uvicorn's own lines, and everything rank 0 logs, in the rank log format.
        assert any("uvicorn.error: Uvicorn running on" in line for line in text.splitlines())
        logged = [line for line in text.splitlines() if " rank0 " in line or "uvicorn" in line]
        assert logged and all(STAMPED.match(line) for line in logged), logged
    assert all(STAMPED.match(line) for line in rank_log.read_text().splitlines())


def _access_record(method: str, target: str, status: int) -> logging.LogRecord:
    """A record as uvicorn's HTTP protocol logs it."""
    return logging.LogRecord(
        ACCESS_LOGGER,
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:50000", method, target, "1.1", status),
        None,
    )


@pytest.mark.parametrize(
    ("method", "target", "status", "poll"),
    [
        ("GET", "/health", 200, True),
        ("HEAD", "/metrics", 200, True),
        ("GET", "/v1/metrics?x=1", 304, True),
        # "Not serving yet", once a second while a model loads: the rank's own lines say why.
        ("GET", "/health", 503, True),
        ("GET", "/health", 500, False),  # a broken health route is news
        ("GET", "/metrics", 503, False),
        ("GET", "/admin/nodes", 401, False),  # and so is a client without the key
        ("POST", "/admin/nodes", 200, False),
        ("GET", "/v1/models/m", 200, False),
        ("POST", "/v1/chat/completions", 200, False),
    ],
)
def test_which_access_lines_are_polls(method: str, target: str, status: int, poll: bool) -> None:
    assert is_monitoring_poll(_access_record(method, target, status)) is poll


def test_a_poll_is_dropped_at_info_and_kept_at_debug() -> None:
    logger = logging.getLogger(ACCESS_LOGGER)
    saved = logger.level
    poll_filter = MonitoringPollFilter()
    try:
        logger.setLevel(logging.INFO)
        assert not poll_filter.filter(_access_record("GET", "/health", 200))
        request = _access_record("POST", "/v1/completions", 200)
        assert poll_filter.filter(request) and request.levelno == logging.INFO
        logger.setLevel(logging.DEBUG)
        poll = _access_record("GET", "/health", 200)
        assert poll_filter.filter(poll)
        assert (poll.levelno, poll.levelname) == (logging.DEBUG, "DEBUG")
    finally:
        logger.setLevel(saved)
