"""`dgpp webui` (the web admin console) and `dgpp webui set-password`.

The console sits above the appliance, so the `dgpp` command line (dgpp.appliance.cli) does not
import it: it finds this command through the `dgpp.commands` entry point (pyproject.toml), which
adds the parser and sets `handler` to the function that runs it."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from dgpp.appliance.common.exit_codes import EXIT_CONFIG, EXIT_OK
from dgpp.engine.errors import ConfigError

log = logging.getLogger("dgpp.webui")

CONFIG_ENV = "DGPP_WEBUI_CONFIG"  # the settings file, e.g. from /etc/dgpp/webui.env


def add_webui_parser(commands: Any) -> None:
    webui = commands.add_parser(
        "webui", help="the web admin console (login required; binds 127.0.0.1 by default)"
    )
    _add_settings(webui)
    webui.add_argument(
        "--no-autostart",
        dest="autostart",
        action="store_false",
        default=argparse.SUPPRESS,
        help="local backend: do not start the engine with the console (settings: autostart)",
    )
    webui.add_argument("--log-level", default="info")
    actions = webui.add_subparsers(dest="webui_command")
    password = actions.add_parser(
        "set-password",
        help="create or replace the console's login (a scrypt hash, mode 0600); give it the "
        "console's own settings (--config or $DGPP_WEBUI_CONFIG, --state-dir, --backend, "
        "--credentials): it writes the credentials file they name",
    )
    _add_settings(password)
    webui.set_defaults(handler=run_webui)
    password.add_argument("--username", default="admin")
    password.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )


def _add_settings(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("console settings (flags win over the settings file)")
    group.add_argument(
        "--config",
        type=Path,
        default=argparse.SUPPRESS,
        help=f"settings file (JSON; also ${CONFIG_ENV})",
    )
    group.add_argument("--deployment", type=Path, default=argparse.SUPPRESS)
    group.add_argument("--backend", choices=("systemd", "local"), default=argparse.SUPPRESS)
    group.add_argument("--host", default=argparse.SUPPRESS, help="bind address (127.0.0.1)")
    group.add_argument("--port", type=int, default=argparse.SUPPRESS, help="(18090)")
    group.add_argument("--state-dir", type=Path, default=argparse.SUPPRESS)
    group.add_argument("--credentials", type=Path, default=argparse.SUPPRESS)
    group.add_argument("--engine-url", default=argparse.SUPPRESS)


def _settings(args: argparse.Namespace) -> Any:
    """The console's settings, resolved the same way for `dgpp webui` and for `set-password`
    (so both name the same credentials file): the file from --config or $DGPP_WEBUI_CONFIG,
    the flags on top, then the defaults that follow from the backend and the state dir."""
    from dgpp.webui.core.config import load_console_config

    keys = (
        "deployment",
        "backend",
        "host",
        "port",
        "state_dir",
        "credentials",
        "engine_url",
        "autostart",
    )
    overrides = {key: getattr(args, key) for key in keys if hasattr(args, key)}
    path = getattr(args, "config", None) or (
        Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None
    )
    return load_console_config(path, overrides)


def run_webui(args: argparse.Namespace) -> int:
    if args.webui_command == "set-password":
        return _set_password(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One INFO line per engine poll (every 2 s) would flood the journal.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = _settings(args)
    from dgpp.webui.security.credentials import load_credentials

    load_credentials(config.credentials)  # refuse to start without a login
    if config.backend == "local" and not config.deployment.exists():
        config.deployment.parent.mkdir(parents=True, exist_ok=True)
        config.deployment.write_text(json.dumps({"model": "default"}, indent=2) + "\n")
        log.info("created %s serving the default model", config.deployment)
    if config.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "the console listens on %s, beyond this machine: put TLS in front of it and set "
            "secure_cookie",
            config.host,
        )
    if config.warm_plans:  # the plans' workers import beside the console's own imports
        from dgpp.webui.plans import worker_pool

        worker_pool.start_early()
    import uvicorn

    from dgpp.webui.app import create_app

    log.info("console on http://%s:%d (%s backend)", config.host, config.port, config.backend)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level.lower(),
        access_log=False,
    )
    return EXIT_OK


def _set_password(args: argparse.Namespace) -> int:
    from dgpp.webui.security.credentials import write_credentials

    config = _settings(args)
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = getpass.getpass("new console password: ")
        if getpass.getpass("again: ") != password:
            print("dgpp: error: the passwords differ", file=sys.stderr)
            return EXIT_CONFIG
    try:
        write_credentials(config.credentials, args.username, password)
    except ConfigError as err:
        print(f"dgpp: error: {err.message}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{config.credentials}: login {args.username!r} set (mode 0600)")
    return EXIT_OK
