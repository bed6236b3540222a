"""`dgpp webui set-password` and the settings the command line builds."""

from __future__ import annotations

import io
import stat
from pathlib import Path

import pytest

from dgpp.appliance.cli import build_parser, main
from dgpp.engine.errors import ConfigError
from dgpp.webui.config import load_console_config
from dgpp.webui.security.credentials import load_credentials


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
