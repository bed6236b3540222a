"""The Logs page and its API on a real local backend over output files written here: the search,
the earlier runs, and what is refused."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dgpp.appliance.common.log_format import log_time
from dgpp.appliance.control.local import LocalBackend
from dgpp.webui.routes.deps import get_backend
from dgpp.webui.routes.log_routes import search_lines
from tests.webui.conftest import Console, running_console

STARTED = 1764583200.0  # 2025-12-01 10:00 UTC
CURRENT = [
    f"{log_time(STARTED)} console: starting dgpp serve --deployment d.json",
    f"{log_time(STARTED + 1)} rank0 INFO dgpp.head: loading /models/small",
    f"{log_time(STARTED + 2)} rank0 WARNING dgpp.head: a <b>bold</b> line",
    f"{log_time(STARTED + 3)} rank0 INFO uvicorn.access: 127.0.0.1:5 - "
    '"POST /v1/chat/completions HTTP/1.1" 200',
    f"{log_time(STARTED + 4)} rank0 ERROR dgpp.head: Error in a step",
    f"{log_time(STARTED + 5)} rank0 INFO dgpp.head: serving m",
]
EARLIER = [
    f"{log_time(STARTED - 600)} console: starting dgpp serve --deployment d.json",
    f"{log_time(STARTED - 599)} rank0 ERROR dgpp.head: cannot serve: out of memory",
]


@pytest.fixture
def logs(tmp_path: Path) -> Iterator[Console]:
    """A logged-in console whose backend reads rank 0's output files in `tmp_path/out`."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank0.log").write_text("\n".join(CURRENT) + "\n")
    (out / "rank0.log.1").write_text("\n".join(EARLIER) + "\n")
    backend = LocalBackend(tmp_path / "deployment.json", out / "rank0.log")
    with running_console(tmp_path) as console:
        console.app.dependency_overrides[get_backend] = lambda: backend
        assert console.login().status_code == 303
        yield console


def test_search_keeps_the_matching_lines_of_the_tail(logs: Console) -> None:
    body = logs.client.get("/api/logs/0", params={"q": "error", "lines": 200}).json()
    assert body["text"].splitlines() == [CURRENT[4]]  # case folded: "ERROR", "Error"
    assert (body["matched"], body["searched"], body["q"]) == (1, len(CURRENT), "error")
    # The search runs over the last `lines` lines only.
    body = logs.client.get("/api/logs/0", params={"q": "INFO", "lines": 2}).json()
    assert body["text"].splitlines() == [CURRENT[5]]
    assert (body["matched"], body["searched"]) == (1, 2)
    everything = logs.client.get("/api/logs/0", params={"lines": 200}).json()
    assert everything["text"] == "\n".join(CURRENT)
    assert everything["matched"] == everything["searched"] == len(CURRENT)
    nothing = logs.client.get("/api/logs/0", params={"q": "no such text"}).json()
    assert (nothing["text"], nothing["matched"]) == ("", 0)


def test_an_earlier_run_is_read_by_its_id(logs: Console) -> None:
    body = logs.client.get("/api/logs/0", params={"run": "1", "q": "memory"}).json()
    assert body["text"] == EARLIER[1] and body["run"] == "1"
    current = logs.client.get("/api/logs/0", params={"run": ""}).json()
    assert current["text"] == "\n".join(CURRENT)
    missing = logs.client.get("/api/logs/0", params={"run": "4"})
    assert missing.status_code == 404 and "no run '4'" in missing.json()["error"]
    assert logs.client.get("/api/logs/0", params={"run": "../x"}).status_code == 422
    assert logs.client.get("/api/logs/64").status_code == 422
    assert logs.client.get("/api/logs/0", params={"q": "x" * 201}).status_code == 422


def test_the_page_has_the_run_selector_and_the_search(logs: Console) -> None:
    page = logs.client.get("/logs", params={"q": "Error", "lines": 100})
    assert page.status_code == 200
    text = page.text
    assert 'id="log-search"' in text and 'value="Error"' in text
    select = re.search(r'<select id="log-run" name="run">(.*?)</select>', text, re.S)
    assert select is not None
    options = re.findall(r'<option value="([^"]*)"( selected)?>([^<]*)</option>', select.group(1))
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(STARTED))
    earlier = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(STARTED - 600))
    assert options == [("", " selected", f"current (since {started})"), ("1", "", earlier)]
    log_text = re.search(r'<pre class="log" id="log-text"[^>]*>(.*?)</pre>', text, re.S)
    assert log_text is not None and html.unescape(log_text.group(1)) == CURRENT[4]
    assert 'data-q="Error"' in text and "1 of the last 6 lines contain" in text
    earlier_page = logs.client.get("/logs", params={"run": "1"}).text
    assert '<option value="1" selected>' in earlier_page and "out of memory" in earlier_page


def test_log_lines_are_escaped_in_the_page(logs: Console) -> None:
    page = logs.client.get("/logs", params={"q": "bold"}).text
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "<b>bold</b>" not in page


def test_a_run_that_is_gone_is_404_with_the_list(logs: Console) -> None:
    page = logs.client.get("/logs", params={"run": "5"})
    assert page.status_code == 404
    assert 'id="log-missing"' in page.text and 'id="log-run"' in page.text


def test_search_lines() -> None:
    assert search_lines("a\nB\nab", "b").text == "B\nab"
    view = search_lines("a\nb", "")
    assert (view.text, view.searched, view.matched) == ("a\nb", 2, 2)
