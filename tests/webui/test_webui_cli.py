"""`dgpp webui set-password` and the settings the command line builds."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dgpp.appliance.cli import build_parser, main
from dgpp.engine.errors import ConfigError
from dgpp.webui.app import create_app
from dgpp.webui.cli import CONFIG_ENV, _settings
from dgpp.webui.core.config import load_console_config
from dgpp.webui.core.engine_address import foreign_engine_url
from dgpp.webui.deployments.store import resolve_raw
from dgpp.webui.security.credentials import load_credentials
from tests.engine.server.harness import free_port
from tests.webui.conftest import console_config, running_console
from tests.webui.fakes import FakeBackend, FakeWorld


def test_set_password_from_stdin_writes_a_0600_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "webui.credentials"
    monkeypatch.setattr("sys.stdin", io.StringIO("a fine password\n"))
    code = main(
        [
            "webui",
            "set-password",
            "--credentials",
            str(path),
            "--username",
            "ops",
            "--password-stdin",
        ]
    )
    assert code == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_credentials(path).verify("ops", "a fine password")
    out = capsys.readouterr().out
    assert "a fine password" not in out and "ops" in out


def test_a_short_password_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    path = tmp_path / "c"
    assert main(["webui", "set-password", "--credentials", str(path), "--password-stdin"]) == 3
    assert not path.exists()


def test_settings_default_to_loopback_and_flags_win(tmp_path: Path) -> None:
    args = build_parser().parse_args(["webui", "--backend", "local", "--state-dir", str(tmp_path)])
    assert args.command == "webui" and args.webui_command is None
    settings = tmp_path / "webui.json"
    settings.write_text('{"port": 19000, "host": "10.0.0.1", "drain_timeout_s": 5}')
    config = load_console_config(settings, {"host": "127.0.0.1", "state_dir": tmp_path})
    assert (config.host, config.port, config.drain_timeout_s) == ("127.0.0.1", 19000, 5.0)
    assert config.deployment == tmp_path / "deployment.json"
    assert config.credentials == tmp_path / "webui.credentials"
    assert (
        load_console_config(None, {"state_dir": tmp_path, "backend": "local"}).host == "127.0.0.1"
    )
    settings.write_text('{"bogus": 1}')
    with pytest.raises(ConfigError, match="bogus"):
        load_console_config(settings, {"state_dir": tmp_path})


def test_the_console_refuses_to_start_without_credentials(tmp_path: Path) -> None:
    code = main(["webui", "--backend", "local", "--state-dir", str(tmp_path)])
    assert code == 3


# --- setup: set-password and the console agree, --no-autostart, an engine_url that is not ours


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`dgpp webui` builds its app but does not serve it; the apps it would have served."""
    apps: list[Any] = []

    def run(app: Any, **_: Any) -> None:
        apps.append(app)

    monkeypatch.setattr("uvicorn.run", run)
    return apps


def _set_password(
    monkeypatch: pytest.MonkeyPatch, *flags: str, before: tuple[str, ...] = ()
) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{PASSWORD}\n"))
    return main(["webui", *before, "set-password", *flags, "--password-stdin"])


PASSWORD = "a fine password"


def test_set_password_and_the_console_resolve_the_same_state_dir(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_serving: list[Any],
) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    state = tmp_path / "state"
    assert main(["webui", "--backend", "local", "--state-dir", str(state)]) == 3  # no login yet
    assert _set_password(monkeypatch, "--backend", "local", "--state-dir", str(state)) == 0
    written = state / "webui.credentials"
    assert capsys.readouterr().out.startswith(f"{written}: login 'admin' set")
    assert load_credentials(written).verify("admin", PASSWORD)
    # The console with the same flags finds that login and goes on to serve.
    assert main(["webui", "--backend", "local", "--state-dir", str(state)]) == 0
    assert len(no_serving) == 1
    # The flags may come before the subcommand too.
    other = tmp_path / "other"
    assert _set_password(monkeypatch, before=("--backend", "local", "--state-dir", str(other))) == 0
    assert capsys.readouterr().out.startswith(f"{other / 'webui.credentials'}: ")


def test_set_password_reads_the_consoles_settings_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = tmp_path / "webui.json"
    state = tmp_path / "from-env"
    settings.write_text(json.dumps({"backend": "local", "state_dir": str(state)}))
    monkeypatch.setenv(CONFIG_ENV, str(settings))
    assert _set_password(monkeypatch) == 0
    assert capsys.readouterr().out.startswith(f"{state / 'webui.credentials'}: ")
    named = tmp_path / "named.credentials"
    explicit = tmp_path / "explicit.json"
    explicit.write_text(json.dumps({"backend": "local", "credentials": str(named)}))
    assert _set_password(monkeypatch, "--config", str(explicit)) == 0  # --config wins over $ENV
    assert load_credentials(named).verify("admin", PASSWORD)
    assert capsys.readouterr().out.startswith(f"{named}: ")
    assert load_console_config(explicit, {}).credentials == named


def test_no_autostart_flag_and_setting(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    assert _settings(parse(["webui", "--state-dir", str(tmp_path)])).autostart is True
    assert (
        _settings(parse(["webui", "--no-autostart", "--state-dir", str(tmp_path)])).autostart
        is False
    )
    settings = tmp_path / "webui.json"
    settings.write_text('{"autostart": false}')
    assert load_console_config(settings, {"state_dir": tmp_path}).autostart is False


def test_an_engine_url_the_local_backend_does_not_run_is_refused_at_start(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_serving: list[Any],
) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    state = tmp_path / "state"
    assert _set_password(monkeypatch, "--backend", "local", "--state-dir", str(state)) == 0
    capsys.readouterr()
    console = ["webui", "--backend", "local", "--state-dir", str(state)]
    assert main([*console, "--engine-url", "http://10.9.8.7:18080"]) == 3
    error = capsys.readouterr().err
    assert "http://10.9.8.7:18080" in error and "http://127.0.0.1:18080" in error
    assert "--no-autostart" in error and "systemd backend" in error
    assert no_serving == []
    # The deployment's own address, however it is written, and a console that starts nothing.
    assert main([*console, "--engine-url", "http://localhost:18080/"]) == 0
    assert main([*console, "--engine-url", "http://10.9.8.7:18080", "--no-autostart"]) == 0
    assert len(no_serving) == 2


def test_without_autostart_the_overview_warns_of_an_engine_it_does_not_run(tmp_path: Path) -> None:
    for folder in ("own", "auto"):
        (tmp_path / folder).mkdir()
    with running_console(tmp_path, engine_url="http://10.9.8.7:9000") as console:
        assert console.login().status_code == 303
        warnings = console.client.get("/api/overview").json()["warnings"]
    ours = [w for w in warnings if "engine_url" in w]
    assert len(ours) == 1
    assert "http://10.9.8.7:9000" in ours[0] and "http://127.0.0.1:18080" in ours[0]
    with running_console(tmp_path / "own", engine_url="http://127.0.0.1:18080") as console:
        assert console.login().status_code == 303
        assert not any(
            "engine_url" in w for w in console.client.get("/api/overview").json()["warnings"]
        )
    config = console_config(tmp_path / "auto", engine_url="http://10.9.8.7:9000", autostart=True)
    with pytest.raises(ConfigError, match="--no-autostart"):
        create_app(config, backend=FakeBackend(FakeWorld(config.deployment)))


def _http(host: str) -> dict[str, Any]:
    return {"host": host, "port": 18080, "allow_unauthenticated": True}


@pytest.mark.parametrize(
    ("url", "host", "foreign"),
    [
        ("http://127.0.0.1:18080", "127.0.0.1", False),
        ("http://localhost:18080", "127.0.0.1", False),
        ("http://[::1]:18080", "127.0.0.1", False),  # loopback is loopback
        ("127.0.0.1:18080", "127.0.0.1", False),  # no scheme
        ("http://127.0.0.1:18081", "127.0.0.1", True),  # another port
        ("http://127.0.0.1", "127.0.0.1", True),  # port 80
        ("http://10.9.8.7:18080", "127.0.0.1", True),  # an engine bound to loopback only
        ("http://127.0.0.1:18080", "0.0.0.0", False),  # bound to every address
        ("http://no-such-host.invalid:18080", "0.0.0.0", True),
    ],
)
def test_foreign_engine_url(url: str, host: str, foreign: bool) -> None:
    deployment = resolve_raw({"model": "default", "http": _http(host)})
    assert (foreign_engine_url(url, deployment) is not None) is foreign


def test_every_address_of_this_machine_reaches_an_engine_bound_to_all() -> None:
    import psutil

    addresses = [
        entry.address
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family == socket.AF_INET and not entry.address.startswith("127.")
    ]
    if not addresses:
        pytest.skip("no IPv4 address but loopback on this machine")
    everywhere = resolve_raw({"model": "default", "http": _http("0.0.0.0")})
    loopback = resolve_raw({"model": "default", "http": {"port": 18080}})
    url = f"http://{addresses[0]}:18080"
    assert foreign_engine_url(url, everywhere) is None
    assert foreign_engine_url(url, loopback) == url


def _start_console(
    monkeypatch: pytest.MonkeyPatch, state: Path, *extra: str
) -> tuple[subprocess.Popen[bytes], httpx.Client]:
    """`dgpp webui --backend local --state-dir STATE --no-autostart`, for real, with the login
    `set-password` wrote; a client logged in to it."""
    flags = ["--backend", "local", "--state-dir", str(state)]
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert _set_password(monkeypatch, *flags) == 0
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != CONFIG_ENV}
    process = subprocess.Popen(
        [sys.executable, "-m", "dgpp.appliance.cli", "webui", *flags, "--no-autostart"]
        + ["--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, process.stderr.read().decode()  # type: ignore[union-attr]
        try:
            page = client.get("/login")
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the console did not answer"
            time.sleep(0.2)
    token = re.search(r'name="csrf_token" value="([^"]*)"', page.text)
    assert token is not None
    login = client.post(
        "/login",
        data={"username": "admin", "password": PASSWORD, "csrf_token": token.group(1)},
        follow_redirects=False,
    )
    assert login.status_code == 303, login.text
    return process, client


def test_the_console_started_without_autostart_takes_the_login_set_password_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For real: `dgpp webui --no-autostart` serves the login `set-password` wrote with the same
    flags, and starts no engine."""
    state = tmp_path / "state"
    process, client = _start_console(monkeypatch, state)
    client.close()
    process.terminate()
    _, err = process.communicate(timeout=30)
    assert not (state / "rank0.log").exists(), err.decode()  # no engine was started


def test_sigterm_ends_the_console_within_2_s_while_it_computes_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45: the console queues every template's memory plan when it starts (tens of
    seconds of CPU on a fresh machine: the large MoE checkpoints' weights are counted on the
    meta device); SIGTERM while they are computed, and while the Models page asks for them,
    still ends it within 2 s, the plan being computed abandoned, not awaited."""
    process, client = _start_console(monkeypatch, tmp_path / "state")
    try:
        fits = client.get("/api/models/fits").json()
        assert fits["pending"] > 0, "nothing was being computed: the test proves nothing"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        client.close()
        process.kill()
    err = process.stderr.read().decode()  # type: ignore[union-attr]
    # uvicorn re-raises the SIGTERM it handled once it has shut down (systemd: a clean stop).
    assert code in (0, -signal.SIGTERM), f"exit {code} after {took:.1f} s\n{err}"
    assert "Traceback" not in err, err
    assert took < 2.0, f"the console took {took:.1f} s to stop\n{err[-2000:]}"
