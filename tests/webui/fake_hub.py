"""A loopback stand-in for the Hugging Face hub: the few endpoints `snapshot_download` calls, with
the headers huggingface_hub reads, and files that can be served slowly so a download is seen in
progress and can be cancelled in the middle.

- `GET /api/models/{repo}/revision/{revision}`: the repo's commit (`sha`) and its `siblings`;
- `GET /api/models/{repo}/tree/{revision}`: the file listing (path, size, git oid);
- `HEAD|GET /{repo}/resolve/{revision}/{file}`: `ETag`, `X-Repo-Commit`, `Content-Length` and,
  for GET, the bytes (throttled for the files named in `FakeRepo.slow`).

An unknown repo answers 404 with `X-Error-Code: RepoNotFound`, as the hub does."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import huggingface_hub
import pytest

CHUNK = 64 * 1024


def allow_downloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache and dgpp home of the test's own, with downloads allowed (the suite may run
    with HF_HUB_OFFLINE, which huggingface_hub reads once, at import) and progress counted
    every 64 KiB instead of every 10 MB. Returns the hub cache."""
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("DGPP_HOME", str(tmp_path / "dgpp"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    return cache


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    slow: dict[str, float] = field(default_factory=dict)  # file -> seconds between 64 KiB chunks

    def oid(self, name: str) -> str:
        return hashlib.sha1(self.files[name]).hexdigest()


@dataclass
class FakeHub:
    url: str
    repos: dict[str, FakeRepo]
    requests: list[str]  # "GET /path" in arrival order
    aborted: threading.Event  # a client went away in the middle of a file


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

        def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, value: object) -> None:
            self._send(200, {"Content-Type": "application/json"}, json.dumps(value).encode())

        def _not_found(self, code: str = "RepoNotFound") -> None:
            body = json.dumps({"error": "Repository not found"}).encode()
            self._send(404, {"X-Error-Code": code, "Content-Type": "application/json"}, body)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            hub.requests.append(f"{self.command} {self.path}")
            path = unquote(urlsplit(self.path).path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                repo = hub.repos.get("/".join(parts[2:4]))
                if repo is None:
                    return self._not_found()
                if parts[4] == "revision":
                    siblings = [{"rfilename": name} for name in repo.files]
                    info = {"id": repo.repo_id, "sha": repo.commit, "siblings": siblings}
                    return self._json(info)
                if parts[4] == "tree":
                    return self._json(
                        [
                            {"type": "file", "path": name, "size": len(data), "oid": repo.oid(name)}
                            for name, data in repo.files.items()
                        ]
                    )
            if len(parts) >= 5 and parts[2] == "resolve":
                repo = hub.repos.get("/".join(parts[:2]))
                if repo is None:
                    return self._not_found()
                name = "/".join(parts[4:])
                if name not in repo.files:
                    return self._not_found("EntryNotFound")
                return self._file(repo, name)
            self._not_found()

        def _file(self, repo: FakeRepo, name: str) -> None:
            data = repo.files[name]
            headers = {
                "ETag": f'"{repo.oid(name)}"',
                "X-Repo-Commit": repo.commit,
                "Content-Length": str(len(data)),
                "Content-Type": "application/octet-stream",
            }
            self.send_response(200)
            for header, value in headers.items():
                self.send_header(header, value)
            self.end_headers()
            if self.command == "HEAD":
                return
            delay = repo.slow.get(name, 0.0)
            try:
                for start in range(0, len(data), CHUNK):
                    self.wfile.write(data[start : start + CHUNK])
                    self.wfile.flush()
                    if delay:
                        time.sleep(delay)
            except (BrokenPipeError, ConnectionResetError):
                hub.aborted.set()
                self.close_connection = True

    return Handler


@contextmanager
def fake_hub(*repos: FakeRepo) -> Iterator[FakeHub]:
    """A hub serving `repos` on 127.0.0.1 (a free port) until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    hub = FakeHub(f"http://{host}:{port}", {r.repo_id: r for r in repos}, [], threading.Event())
    server.RequestHandlerClass = _handler(hub)
    thread = threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
