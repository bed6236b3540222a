"""The dgpp_webui role's sudoers drop-in allows exactly the command lines the console's systemd
backend runs: a drift between the two would leave the console unable to restart rank 0."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from dgpp.appliance.control.systemd import CommandResult, SystemdBackend
from tests.playbooks.staging import PLAYBOOKS


def test_sudo_commands_are_the_systemd_backends_own():
    calls: list[list[str]] = []

    def record(argv: Sequence[str]) -> CommandResult:
        calls.append(list(argv))
        return CommandResult(0, "", "")

    backend = SystemdBackend(Path("/etc/dgpp/deployment.json"), runner=record)
    backend.start()
    backend.stop()
    backend.restart()
    backend.status()
    role_vars = yaml.safe_load((PLAYBOOKS / "roles/dgpp_webui/vars/main.yml").read_text())
    allowed = sorted(command.split() for command in role_vars["dgpp_webui_sudo_commands"])
    assert all(call[0] == "systemctl" for call in calls)
    assert sorted(call[1:] for call in calls) == allowed
