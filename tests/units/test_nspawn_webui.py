"""A one-host cluster under a real systemd: `playbooks/cluster.yml` installs it into a booted
container (`one_host.py`, `container.py`), rank 0 serving SmolLM2 on CPU under its unit (enabled
with `dgpp.target` and `dgpp-tune`, "ready in" in its journal), and a second run changes nothing.
Then `dgpp-webui.service`: the console started by the unit is driven with curl from inside the
container: the login form and its CSRF cookie, a login with the generated password, the overview
page, the JSON overview (rank 0's unit seen through `systemctl show`) and the rank's journal, and
the refusals of requests without a session.

The container has sudo but no polkitd, so the role (`dgpp_webui_restart_via: auto`) picks sudo:
its drop-in passes `visudo`, and user dgpp-webui may run exactly the systemctl command lines of the
console's systemd backend with `sudo -n`, nothing else. Then the restart path end to end: the
Knobs form sets `speculative.method` to ngram, the switch drains, rewrites the deployment file,
restarts `dgpp@rank0` through sudo (a new MainPID and InvocationID, a new `instance` on `/health`)
and rank 0's `/v1/metrics` reports ngram; and a deployment whose checkpoint does not exist is
rolled back as soon as systemd restarts the rank that exited (the unit never becomes `failed`).

    DGPP_NSPAWN=1 /tmp/venv/bin/python -m pytest tests/units/test_nspawn_webui.py -s
"""

from __future__ import annotations

import html
import json
import re
import shlex
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dgpp.appliance.control.systemd import CommandResult, SystemdBackend
from tests.units.container import Container, missing_tools, stage_checkout
from tests.units.one_host import (
    ANSIBLE_PLAYBOOK,
    HEALTH,
    MODEL,
    changed_tasks,
    one_host_inventory,
    run_playbook,
)

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
AUTHED = "curl -s -b /root/console.jar"
AS_CONSOLE = "runuser -u dgpp-webui -- sudo -n"  # what the console's `systemctl` setting runs
AS_RANKS = "runuser -u dgpp --"  # the ranks' user
SUDOERS = "/etc/sudoers.d/dgpp-webui"
DEPLOYMENT_FILE = "/etc/dgpp/deployment.json"
PREVIEW_ROW = (
    r'<td class="key">([^<]+)</td><td class="old">([^<]*)</td><td class="new">([^<]*)</td>'
)
HIDDEN = r'<input type="hidden" name="([^"]+)" value="([^"]*)">'
FIRST_RUN: dict[str, Path] = {}  # the fixture's inventory, for the second run


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
        inventory.write_text(json.dumps(one_host_inventory(box.leader or 0)))
        result, seconds = run_playbook(inventory)
        assert result.returncode == 0, (
            result.stdout[-6000:] + result.stderr[-3000:] + _console_journal(box)
        )
        print(f"\nplaybook: {seconds:.1f} s")
        # sudo is there and polkitd is not: the role writes the sudoers drop-in.
        assert "logs but cannot restart rank 0" not in result.stdout
        sudo_task = (
            "TASK [dgpp_webui : Ensure sudo lets the console run exactly its systemctl commands]"
        )
        assert sudo_task in changed_tasks(result.stdout), result.stdout[-6000:]
        FIRST_RUN["inventory"] = inventory
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


def test_the_playbook_brings_up_a_serving_rank(console: Container) -> None:
    box = console
    assert box.sh(HEALTH).stdout == "200"
    status = box.sh("systemctl show dgpp@rank0 -p ActiveState -p StatusText").stdout
    assert "ActiveState=active" in status and "StatusText=serving smollm2" in status, status
    assert box.sh("systemctl is-enabled dgpp@rank0 dgpp.target dgpp-tune").returncode == 0
    assert "ready in" in box.sh("journalctl -u dgpp@rank0 --no-pager -o cat").stdout


def test_a_second_playbook_run_changes_nothing(console: Container) -> None:
    """Before any test below changes the deployment or the console's state."""
    result, seconds = run_playbook(FIRST_RUN["inventory"])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    changed = changed_tasks(result.stdout)
    print(f"\nsecond run: {seconds:.1f} s; changed: {changed}")
    assert console.sh(HEALTH).stdout == "200"
    assert changed == []


def test_systemctl_reload_is_taken_by_rank_0_in_place(console: Container) -> None:
    """`systemctl reload dgpp@rank0` (ExecReload: SIGHUP) reads the deployment again, here
    unchanged: the same process serves on and its journal says so."""
    box = console
    before = box.sh("systemctl show -p MainPID --value dgpp@rank0").stdout.strip()
    box.sh("systemctl reload dgpp@rank0")
    journal = ""
    for _ in range(50):
        journal = box.sh("journalctl -u dgpp@rank0 --no-pager -o cat").stdout
        if "reloaded: the deployment is unchanged" in journal:
            break
        time.sleep(0.2)
    assert "reloaded: the deployment is unchanged" in journal, journal[-3000:]
    assert box.sh("systemctl show -p MainPID --value dgpp@rank0").stdout.strip() == before
    assert box.sh(HEALTH).stdout == "200"


def test_the_unit_runs_the_console_as_its_own_user(console: Container) -> None:
    box = console
    assert box.sh("systemctl is-enabled dgpp-webui").stdout.strip() == "enabled"
    box.sh("systemctl stop dgpp-webui")
    started = time.monotonic()
    box.sh("systemctl start dgpp-webui")
    _wait_for_login_page(box)
    print(f"\nsystemctl start dgpp-webui until /login answers: {time.monotonic() - started:.1f} s")
    pid = box.sh("systemctl show -p MainPID --value dgpp-webui").stdout.strip()
    assert box.sh(f"stat -c %U /proc/{pid}").stdout.strip() == "dgpp-webui"
    groups = box.sh(
        f"grep ^Groups: /proc/{pid}/status; getent group systemd-journal dgpp"
    ).stdout.split("\n")
    for line in groups[1:3]:  # SupplementaryGroups=dgpp systemd-journal
        assert line.split(":")[2] in groups[0].split(), groups
    listening = box.sh("ss -Hltn 'sport = :18090'", check=False).stdout
    assert "127.0.0.1:18090" in listening, listening
    modes = box.sh(
        f"stat -c '%n %U %a' /etc/dgpp/webui.credentials {PASSWORD_FILE} /etc/dgpp/webui.json"
    ).stdout.split("\n")
    assert modes[:3] == [
        "/etc/dgpp/webui.credentials dgpp-webui 600",
        f"{PASSWORD_FILE} root 600",
        "/etc/dgpp/webui.json root 640",
    ]
    assert "DGPP_WEBUI_PASSWORD_HASH=scrypt$" in box.sh("cat /etc/dgpp/webui.credentials").stdout
    # The ranks' user reads none of the console's secrets and has none of its sudo rights; it
    # still reads the deployment the console owns (group dgpp).
    for path in ("/etc/dgpp/webui.credentials", "/var/lib/dgpp-webui/sessions.sqlite"):
        assert box.sh(f"{AS_RANKS} cat {path}", check=False).returncode != 0, path
    assert box.sh(f"{AS_RANKS} sudo -n -l", check=False).returncode != 0
    assert box.sh(f"stat -c '%U:%G %a' {DEPLOYMENT_FILE}").stdout.strip() == "dgpp-webui:dgpp 640"
    assert box.sh(f"{AS_RANKS} cat {DEPLOYMENT_FILE}").returncode == 0


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


def _backend_commands(systemctl: Sequence[str]) -> list[list[str]]:
    """Every command line the console's systemd backend runs (start, stop, restart, status)."""
    recorded: list[list[str]] = []

    def record(argv: Sequence[str]) -> CommandResult:
        recorded.append(list(argv))
        return CommandResult(0, "", "")

    backend = SystemdBackend(Path(DEPLOYMENT_FILE), runner=record, systemctl=systemctl)
    for action in (backend.start, backend.stop, backend.restart, backend.status):
        action()
    return recorded


def test_sudo_lets_the_console_run_its_commands_and_nothing_else(console: Container) -> None:
    box = console
    settings = json.loads(box.sh("cat /etc/dgpp/webui.json").stdout)
    assert settings["systemctl"] == ["sudo", "-n", "/usr/bin/systemctl"]
    assert box.sh(f"stat -c '%U:%G %a' {SUDOERS}").stdout.strip() == "root:root 440"
    assert box.sh(f"visudo -cf {SUDOERS}").stdout.strip() == f"{SUDOERS}: parsed OK"
    box.sh("visudo -c")  # the whole policy, with the drop-in
    commands = _backend_commands(settings["systemctl"][2:])
    assert len(commands) == 4
    for argv in commands:  # `sudo -l COMMAND`: whether it is allowed, without running it
        listed = box.sh(f"{AS_CONSOLE} -l {shlex.join(argv)}", check=False)
        assert (listed.returncode, listed.stdout.split()) == (0, argv), listed
    show = box.sh(f"{AS_CONSOLE} {shlex.join(commands[-1])}").stdout  # status: read-only, run it
    assert "Id=dgpp@rank0.service" in show and "ActiveState=active" in show, show
    systemctl = settings["systemctl"][2]
    refused = [
        f"{systemctl} restart dgpp@rank0",  # the backend's has --no-block
        f"{systemctl} restart --no-block dgpp@rank0 other.service",
        f"{systemctl} stop dgpp@rank1",
        f"{systemctl} edit dgpp@rank0",
        f"-u root {systemctl} restart ssh",
        "/bin/sh -c id",
        "id",
    ]
    for command in refused:
        listed = box.sh(f"{AS_CONSOLE} -l {command}", check=False)
        assert listed.returncode == 1, (command, listed)
    for command in ("id", f"-u root {systemctl} restart ssh"):
        ran = box.sh(f"{AS_CONSOLE} {command}", check=False)
        assert ran.returncode == 1 and "a password is required" in ran.stderr, (command, ran)


def _login_and_token(box: Container) -> str:
    """A fresh session; its CSRF token, from the Knobs page."""
    _wait_for_login_page(box)
    assert box.sh(LOGIN).stdout == f"303 {CONSOLE}/"
    page = box.sh(f"{AUTHED} {CONSOLE}/knobs").stdout
    match = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert match is not None, page[:2000]
    return match.group(1)


def _post(box: Container, path: str, fields: dict[str, str]) -> tuple[str, str]:
    """POST a form with the session: ("<status> <redirect>", body)."""
    data = " ".join("--data-urlencode " + shlex.quote(f"{k}={v}") for k, v in fields.items())
    out = box.sh(f"{AUTHED} -w '\\n%{{http_code}} %{{redirect_url}}' {data} {CONSOLE}{path}")
    body, _, status = out.stdout.rpartition("\n")
    return status, body


def _follow_switch(box: Container, timeout_s: float) -> dict[str, Any]:
    started = time.monotonic()
    while True:
        body = json.loads(box.sh(f"{AUTHED} {CONSOLE}/api/switch").stdout)
        if body["job"] is not None and body["job"]["final"]:
            return body["job"]
        assert time.monotonic() - started < timeout_s, json.dumps(body) + _console_journal(box)
        time.sleep(0.5)


def _engine(box: Container) -> tuple[str, str]:
    """curl for rank 0's HTTP server (with the deployment's API key, if it has one), its URL."""
    http = json.loads(box.sh(f"cat {DEPLOYMENT_FILE}").stdout)["http"]
    curl = "curl -s"
    if http.get("api_key_file"):
        curl += f' -H "Authorization: Bearer $(cat {shlex.quote(http["api_key_file"])})"'
    return curl, f"http://127.0.0.1:{http['port']}"


def _rank0_unit(box: Container) -> dict[str, str]:
    shown = box.sh("systemctl show -p MainPID -p InvocationID -p ActiveState dgpp@rank0").stdout
    return dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)


def test_a_knobs_switch_restarts_rank_0_through_sudo(console: Container) -> None:
    box = console
    token = _login_and_token(box)
    curl, engine = _engine(box)
    unit_before = _rank0_unit(box)
    instance_before = json.loads(box.sh(f"{curl} {engine}/health").stdout)["instance"]
    metrics = json.loads(box.sh(f"{curl} {engine}/v1/metrics").stdout)
    assert metrics["spec_decode"]["method"] == "off"
    fields = {"csrf_token": token, "speculative.method": "ngram"}
    status, preview = _post(box, "/knobs/preview", fields)
    assert status == "200 ", preview[-3000:]
    rows = [tuple(html.unescape(cell) for cell in row) for row in re.findall(PREVIEW_ROW, preview)]
    assert rows == [("speculative.method", '"off"', '"ngram"')]
    # The preview's Apply form: its hidden fields, posted as the button would.
    apply = dict(re.findall(HIDDEN, preview.split('action="/switch"', 1)[1]))
    apply = {name: html.unescape(value) for name, value in apply.items()}
    assert set(apply) == {"csrf_token", "title", "deployment"}
    started = time.monotonic()
    assert _post(box, "/switch", apply)[0] == f"303 {CONSOLE}/switch"
    job = _follow_switch(box, timeout_s=180.0)
    seconds = time.monotonic() - started
    assert job["phase"] == "ready", job
    print(f"\nknobs switch (speculative.method ngram) through sudo: ready in {seconds:.1f} s")
    assert json.loads(box.sh(f"cat {DEPLOYMENT_FILE}").stdout)["speculative"] == {"method": "ngram"}
    unit_after = _rank0_unit(box)
    assert unit_after["ActiveState"] == "active"
    assert unit_after["MainPID"] != unit_before["MainPID"]
    assert unit_after["InvocationID"] != unit_before["InvocationID"]
    assert box.sh(f"{curl} -o /dev/null -w '%{{http_code}}' {engine}/health").stdout == "200"
    health = json.loads(box.sh(f"{curl} {engine}/health").stdout)
    assert health["state"] == "serving" and health["instance"] != instance_before, health
    metrics = json.loads(box.sh(f"{curl} {engine}/v1/metrics").stdout)
    assert metrics["spec_decode"]["method"] == "ngram", metrics["spec_decode"]
    journal = box.sh("journalctl -t sudo --no-pager -o cat").stdout  # sudo logs what it ran
    assert "COMMAND=/usr/bin/systemctl restart --no-block dgpp@rank0" in journal, journal[-2000:]


def test_a_deployment_that_cannot_load_is_rolled_back(console: Container) -> None:
    box = console
    token = _login_and_token(box)
    curl, engine = _engine(box)
    kept = json.loads(box.sh(f"cat {DEPLOYMENT_FILE}").stdout)
    # What the Apply button posts, with a checkpoint that does not exist: the schema accepts it,
    # rank 0 exits 3, and systemd (Restart=always) starts it again: the unit is never `failed`.
    broken = {**kept, "model": "/srv/models/missing"}
    fields = {"csrf_token": token, "title": "Broken", "deployment": json.dumps(broken)}
    started = time.monotonic()
    assert _post(box, "/switch", fields)[0] == f"303 {CONSOLE}/switch"
    job = _follow_switch(box, timeout_s=120.0)  # far below the console's ready_timeout_s, 900 s
    seconds = time.monotonic() - started
    assert job["phase"] == "rolled back", job
    assert job["reason"].startswith("rank 0 exited and is restarting"), job["reason"]
    # the reason names the root cause from rank 0's log (webui/switch/root_cause.py), not the exit
    # code
    assert "no such checkpoint directory: /srv/models/missing" in job["reason"], job["reason"]
    assert "no such checkpoint directory: /srv/models/missing" in job["log_tail"]
    print(f"\nswitch to a missing checkpoint: rolled back in {seconds:.1f} s")
    assert json.loads(box.sh(f"cat {DEPLOYMENT_FILE}").stdout) == kept
    health = json.loads(box.sh(f"{curl} {engine}/health").stdout)
    assert health["state"] == "serving" and health["model"] == "smollm2", health
    assert _rank0_unit(box)["ActiveState"] == "active"
