"""`dgpp-webui.service` under a real systemd: `playbooks/cluster.yml` installs a one-host cluster
into a booted container (as `test_nspawn_playbook.py` does, see `container.py`), rank 0 serving
SmolLM2 on CPU, and the console started by the unit is then driven with curl from inside the
container: the login form and its CSRF cookie, a login with the generated password, the overview
page, the JSON overview (rank 0's unit seen through `systemctl show`) and the rank's journal, and
the refusals of requests without a session.

The container has neither polkit nor sudo (and no network to install them), so the role leaves
the console without a way to restart rank 0 and says so; that path is not exercised here.

    DGPP_NSPAWN=1 /tmp/venv/bin/python -m pytest tests/units/test_nspawn_webui.py -s
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.units.container import Container, missing_tools, stage_checkout
from tests.units.test_nspawn_playbook import ANSIBLE_PLAYBOOK, MODEL, _inventory, _playbook

pytestmark = pytest.mark.nspawn

CONSOLE = "http://127.0.0.1:18090"
PASSWORD_FILE = "/etc/dgpp/webui.initial-password"
# Inside the container: the login page's CSRF token, then the login itself, keeping the cookies.
LOGIN = f"""set -e
jar=/root/console.jar
rm -f $jar
token=$(curl -sf -c $jar {CONSOLE}/login |
    sed -n 's/.*name="csrf_token" value="\\([^"]*\\)".*/\\1/p')
test -n "$token"
curl -s -b $jar -c $jar -o /dev/null -w '%{{http_code}} %{{redirect_url}}' \\
    --data-urlencode username=admin --data-urlencode "password=$(cat {PASSWORD_FILE})" \\
    --data-urlencode "csrf_token=$token" --data-urlencode next=/ {CONSOLE}/login
"""
STATUS = "curl -s -o /dev/null -w '%{http_code}'"


@pytest.fixture(scope="module")
def console(
    tmp_path_factory: pytest.TempPathFactory, default_checkpoint: Path
) -> Iterator[Container]:
    missing = missing_tools() + ([] if ANSIBLE_PLAYBOOK.exists() else ["ansible-playbook"])
    if missing:
        pytest.skip("cannot boot a container here, missing: " + ", ".join(missing))
    work = tmp_path_factory.mktemp("nspawn-webui")
    stage_checkout(work / "src")  # the playbook runs from this copy
    box = Container(work / "container", {str(default_checkpoint): MODEL}, machine="dgpp-webui")
    try:
        box.start()
        inventory = work / "inventory.json"
        inventory.write_text(json.dumps(_inventory(box.leader or 0)))
        result, seconds = _playbook(inventory)
        assert result.returncode == 0, (
            result.stdout[-6000:] + result.stderr[-3000:] + _console_journal(box)
        )
        print(f"\nplaybook: {seconds:.1f} s")
        assert (
            "the console shows the ranks and their logs but cannot restart rank 0" in result.stdout
        )
        yield box
    finally:
        box.stop()


def _console_journal(box: Container) -> str:
    return box.sh(
        "systemctl status dgpp-webui --no-pager; journalctl -u dgpp-webui --no-pager -n 60",
        check=False,
    ).stdout


def _wait_for_login_page(box: Container, timeout_s: float = 60.0) -> None:
    started = time.monotonic()
    while box.sh(f"{STATUS} {CONSOLE}/login", check=False).stdout != "200":
        assert time.monotonic() - started < timeout_s, _console_journal(box)
        time.sleep(0.2)


def test_the_unit_runs_the_console_as_dgpp(console: Container) -> None:
    box = console
    assert box.sh("systemctl is-enabled dgpp-webui").stdout.strip() == "enabled"
    box.sh("systemctl stop dgpp-webui")
    started = time.monotonic()
    box.sh("systemctl start dgpp-webui")
    _wait_for_login_page(box)
    print(f"\nsystemctl start dgpp-webui until /login answers: {time.monotonic() - started:.1f} s")
    pid = box.sh("systemctl show -p MainPID --value dgpp-webui").stdout.strip()
    assert box.sh(f"stat -c %U /proc/{pid}").stdout.strip() == "dgpp"
    groups = box.sh(f"grep ^Groups: /proc/{pid}/status; getent group systemd-journal").stdout
    journal_gid = groups.split("\n")[1].split(":")[2]
    assert journal_gid in groups.split("\n")[0].split()  # SupplementaryGroups=systemd-journal
    listening = box.sh("ss -Hltn 'sport = :18090'", check=False).stdout
    assert "127.0.0.1:18090" in listening, listening
    modes = box.sh(
        f"stat -c '%n %U %a' /etc/dgpp/webui.credentials {PASSWORD_FILE} /etc/dgpp/webui.json"
    ).stdout.split("\n")
    assert modes[:3] == [
        "/etc/dgpp/webui.credentials dgpp 600",
        f"{PASSWORD_FILE} root 600",
        "/etc/dgpp/webui.json root 640",
    ]
    assert "DGPP_WEBUI_PASSWORD_HASH=scrypt$" in box.sh("cat /etc/dgpp/webui.credentials").stdout


def test_a_login_opens_the_overview_and_the_api(console: Container) -> None:
    box = console
    _wait_for_login_page(box)
    assert box.sh(LOGIN).stdout == f"303 {CONSOLE}/"
    authed = "curl -sf -b /root/console.jar"
    page = box.sh(f"{authed} {CONSOLE}/").stdout
    assert "smollm2" in page and "Overview" in page, page[:2000]
    overview = json.loads(box.sh(f"{authed} {CONSOLE}/api/overview").stdout)
    assert overview["backend"] == "systemd"
    assert overview["deployment"]["served_names"] == ["smollm2"]
    assert overview["health"]["serving"] is True, overview["health"]
    rank0 = overview["ranks"][0]
    assert (rank0["rank"], rank0["state"]) == (0, "running"), overview["ranks"]
    logs = json.loads(box.sh(f"{authed} '{CONSOLE}/api/logs/0?lines=500'").stdout)
    assert "ready in" in logs["text"], logs["text"][-2000:]  # the journal of dgpp@rank0


def test_requests_without_a_session_are_refused(console: Container) -> None:
    box = console
    _wait_for_login_page(box)
    assert box.sh(f"{STATUS} {CONSOLE}/api/overview").stdout == "401"
    assert box.sh(f"{STATUS} {CONSOLE}/api/logs/0").stdout == "401"
    redirect = box.sh(f"curl -s -o /dev/null -w '%{{http_code}} %{{redirect_url}}' {CONSOLE}/")
    assert redirect.stdout == f"303 {CONSOLE}/login?next=%2F"
    # A login without the form's token, and one with a wrong password, get no session.
    no_token = (
        f"curl -s -o /dev/null -w '%{{http_code}}' -d username=admin -d password=x {CONSOLE}/login"
    )
    assert box.sh(no_token).stdout == "403"
    wrong = LOGIN.replace(f"$(cat {PASSWORD_FILE})", "not-the-password")
    assert box.sh(wrong).stdout.startswith("401 ")
    assert "dgpp_console" not in box.sh("cat /root/console.jar").stdout  # no session cookie
