"""Real coding agents against a real `dgpp serve`: Claude Code (`claude -p`, the Anthropic
Messages API, streamed) and Codex (`codex exec`, the Responses API, streamed), both unmodified
and installed from npm into a cache outside the repository (skipped, saying why, where node or
the registry is absent). The model is a tiny scripted Llama with a 64K context (see
`scripted_model`); the server requires an API key, as a LAN deployment does. A run passes when
the agent exits 0 with the model's answer and the server answered no request with 4xx or 5xx.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.agents.npm_tools import npm_binary
from tests.agents.scripted_model import ANSWER, CONTEXT, build_agent_model
from tests.appliance.world_harness import DgppProcess, start, wait_healthy
from tests.engine.server.harness import free_port

CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.332", "claude")
CODEX = ("@openai/codex", "0.171.0", "codex")
KEY = "sk-dgpp-agents-test"
ACCESS_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')


@dataclass
class AgentServer:
    url: str
    process: DgppProcess

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request in the server's access log."""
        return [
            (m["method"], m["path"], int(m["status"]))
            for m in ACCESS_LINE.finditer(self.process.text())
        ]


@pytest.fixture(scope="module")
def agent_server(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Iterator[AgentServer]:
    root = tmp_path_factory.mktemp("agents")
    model = build_agent_model(root / "model", tokenizer_dir)
    key_file = root / "api-key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    args = [
        "serve", "--model", str(model), "--port", str(port), "--api-key-file", str(key_file),
        "--served-model-name", "default", "--served-model-name", "*",
        "--max-model-len", str(CONTEXT), "--kv-capacity", str(CONTEXT + 4096),
    ]  # fmt: skip
    process = start(args, root / "serve.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        yield AgentServer(f"http://127.0.0.1:{port}", process)
    finally:
        process.stop()


def _run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        env={"PATH": os.environ["PATH"], **env},
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _sessions(server: AgentServer) -> dict[str, dict[str, object]]:
    """The key's agent sessions (`GET /v1/sessions`) by id."""
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.get(f"{server.url}/v1/sessions", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    return {row["id"]: row for row in response.json()["data"]}


def _assert_new_session(server: AgentServer, before: dict[str, dict[str, object]]) -> None:
    """The agent's requests carried its session (Claude Code: `metadata.user_id`; Codex:
    `prompt_cache_key`), which the server now lists with its requests."""
    new = {name: row for name, row in _sessions(server).items() if name not in before}
    assert new, f"no session from the agent's requests (had {sorted(before)})"
    assert all(int(row["requests"]) >= 1 for row in new.values()), new  # type: ignore[call-overload]


def _assert_served_cleanly(server: AgentServer, path: str, before: int) -> None:
    requests = server.requests()[before:]
    assert any(p.startswith(path) and s == 200 for _, p, s in requests), requests
    failed = [r for r in requests if r[2] >= 400]
    assert not failed, f"the server refused requests: {failed}\n{server.process.text()[-4000:]}"


def test_claude_code_completes_a_one_shot_task(agent_server: AgentServer, tmp_path: Path) -> None:
    claude = npm_binary(*CLAUDE_CODE)
    before = len(agent_server.requests())
    sessions = _sessions(agent_server)
    result = _run(
        [str(claude), "-p", "Say hi."],
        {
            "HOME": str(tmp_path),
            "ANTHROPIC_BASE_URL": agent_server.url,
            "ANTHROPIC_API_KEY": KEY,
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        },
        tmp_path,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert ANSWER in result.stdout
    _assert_served_cleanly(agent_server, "/v1/messages", before)
    _assert_new_session(agent_server, sessions)


def test_codex_completes_a_one_shot_task(agent_server: AgentServer, tmp_path: Path) -> None:
    codex = npm_binary(*CODEX)
    home = tmp_path / "codex-home"
    home.mkdir()
    provider = (
        f'{{name="dgpp", base_url="{agent_server.url}/v1", env_key="DGPP_API_KEY", '
        'wire_api="responses"}'
    )
    before = len(agent_server.requests())
    sessions = _sessions(agent_server)
    result = _run(
        [
            str(codex),
            "exec",
            "--skip-git-repo-check",
            "-m",
            "default",
            "-c",
            "model_provider=dgpp",
            "-c",
            f"model_providers.dgpp={provider}",
            "Say hi.",
        ],
        {"HOME": str(tmp_path), "CODEX_HOME": str(home), "DGPP_API_KEY": KEY},
        tmp_path,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert ANSWER in result.stdout
    _assert_served_cleanly(agent_server, "/v1/responses", before)
    _assert_new_session(agent_server, sessions)
