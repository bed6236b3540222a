"""The units under a real systemd (254, Debian bookworm-backports) booted in a throwaway
container (see `container.py`): dgpp installed from this checkout into /opt/dgpp/venv, the units
into /etc/systemd/system, rank env files and a deployment of SmolLM2-135M-Instruct (the host's
converted default model, bind-mounted read-only) under /etc/dgpp. Nothing here is a stand-in
except the missing GPU: the container runs on CPU, and has no nvidia-smi.

Run as root (minutes; the container's root is built once into /var/cache/dgpp-test):

    DGPP_NSPAWN=1 /tmp/venv/bin/python -m pytest tests/units/test_nspawn.py -s
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.units.container import Container, missing_tools, stage_checkout

pytestmark = pytest.mark.nspawn

MODEL = "/srv/models/SmolLM2-135M-Instruct"
SOURCE = "/srv/dgpp-src"
HEALTH = "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:18080/health"
UNITS = ["dgpp@rank0.service", "dgpp@rank1.service", "dgpp-tune.service", "dgpp-webui.service"]
INSTALL = f"""set -e
useradd --system --home-dir /var/lib/dgpp --create-home --shell /usr/sbin/nologin dgpp
cp -r {SOURCE} /var/tmp/dgpp-src
/opt/dgpp/venv/bin/pip install -q --no-index --no-build-isolation /var/tmp/dgpp-src
install -d /usr/local/libexec/dgpp /etc/dgpp
install -m 0755 /var/tmp/dgpp-src/units/dgpp-tune /usr/local/libexec/dgpp/dgpp-tune
install -m 0644 /var/tmp/dgpp-src/units/*.service /var/tmp/dgpp-src/units/*.target \\
    /etc/systemd/system/
echo DGPP_GPU_CLOCKS=900,2100 > /etc/dgpp/tune.env
cat > /etc/dgpp/rank0.env <<EOF
DGPP_RANK=0
DGPP_HEAD=127.0.0.1
DGPP_RENDEZVOUS_PORT=29517
DGPP_DEPLOYMENT=/etc/dgpp/deployment.json
EOF
cat > /etc/dgpp/rank1.env <<EOF
DGPP_RANK=1
DGPP_HEAD=127.0.0.1
DGPP_RENDEZVOUS_PORT=29517
EOF
systemctl daemon-reload
systemctl enable dgpp.target dgpp-tune.service dgpp@rank0.service
"""
TIMINGS: dict[str, float] = {}


def _deployment(world_size: int) -> str:
    raw = {
        "model": MODEL,
        "world_size": world_size,
        "engine": {"kv_capacity": 2048, "num_threads": 2 // world_size},
        "http": {"port": 18080, "served_model_names": ["smollm2"]},
        "rendezvous": {"head": "127.0.0.1", "port": 29517},
        "timeouts": {"heartbeat_s": 1.0, "control_deadline_s": 10.0},
    }
    return json.dumps(raw)


@pytest.fixture(scope="module")
def container(
    tmp_path_factory: pytest.TempPathFactory, default_checkpoint: Path
) -> Iterator[Container]:
    missing = missing_tools()
    if missing:
        pytest.skip("cannot boot a container here, missing: " + ", ".join(missing))
    work = tmp_path_factory.mktemp("nspawn")
    source = stage_checkout(work / "src")
    box = Container(work / "container", {str(source): SOURCE, str(default_checkpoint): MODEL})
    started = time.monotonic()
    try:
        TIMINGS["boot"] = box.start()
        box.sh(INSTALL)
        TIMINGS["install"] = time.monotonic() - started - TIMINGS["boot"]
        yield box
    finally:
        box.stop()
        print("\ntimings (s):", json.dumps({k: round(v, 2) for k, v in TIMINGS.items()}))


def _show(box: Container, unit: str, *properties: str) -> dict[str, str]:
    out = box.sh(f"systemctl show {unit} " + " ".join(f"-p {name}" for name in properties))
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def _timed(box: Container, script: str, name: str) -> None:
    started = time.monotonic()
    box.sh(script)
    TIMINGS[name] = time.monotonic() - started


def _journal(box: Container, unit: str) -> str:
    return box.sh(f"journalctl -u {unit} --no-pager -o cat").stdout


def _weights_s(ready_line: str) -> float:
    return float(re.search(r"weights ([0-9.]+) s", ready_line).group(1))  # type: ignore[union-attr]


def test_units_verify_clean_on_systemd_254(container: Container) -> None:
    """Installed for real (no stand-ins), systemd 254 knows every key: RestartSteps too."""
    version = container.sh("systemctl --version").stdout.split()[1]
    assert int(version) >= 254
    result = container.sh("cd /etc/systemd/system && systemd-analyze verify " + " ".join(UNITS))
    assert result.stderr == "", result.stderr


def test_start_returns_only_once_serving_and_restart_is_faster(container: Container) -> None:
    container.sh(f"cat > /etc/dgpp/deployment.json <<'EOF'\n{_deployment(1)}\nEOF")
    _timed(container, "systemctl start dgpp@rank0", "systemctl start dgpp@rank0 (cold)")
    # Type=notify: the very first request after `systemctl start` returns already succeeds.
    assert container.sh(HEALTH).stdout == "200"
    state = _show(container, "dgpp@rank0", "ActiveState", "SubState", "StatusText")
    assert state["ActiveState"] == "active" and state["SubState"] == "running", state
    assert state["StatusText"].startswith("serving smollm2 on 127.0.0.1:18080 (world of 1"), state

    _timed(container, "systemctl restart dgpp@rank0", "systemctl restart dgpp@rank0 (resident)")
    assert container.sh(HEALTH).stdout == "200"
    ready = [line for line in _journal(container, "dgpp@rank0").splitlines() if "ready in" in line]
    assert len(ready) == 2, ready
    print("\n" + "\n".join(ready))
    assert _weights_s(ready[1]) < _weights_s(ready[0]), ready  # mapped from the resident image


def test_a_killed_rank_is_restarted_by_systemd(container: Container) -> None:
    container.sh("systemctl kill --signal=SIGKILL dgpp@rank0")
    deadline = time.monotonic() + 120
    while container.sh(HEALTH, check=False).stdout != "200":
        assert time.monotonic() < deadline, _journal(container, "dgpp@rank0")[-3000:]
        time.sleep(0.5)
    assert _show(container, "dgpp@rank0", "NRestarts")["NRestarts"] == "1"


def test_a_frozen_rank_is_restarted_by_the_watchdog(container: Container) -> None:
    """SIGSTOP freezes the rank, its WATCHDOG=1 pings stop, and systemd aborts it (SIGKILL once
    TimeoutAbortSec passed: a stopped process holds SIGABRT) and restarts it. A drop-in shortens
    the unit's WatchdogSec=30s to 6 s to keep the test short; the keys themselves are the unit's."""
    dropin = "/etc/systemd/system/dgpp@rank0.service.d"
    container.sh(
        f"mkdir -p {dropin} && printf '[Service]\\nWatchdogSec=6s\\n' > {dropin}/watchdog.conf"
        " && systemctl daemon-reload && systemctl restart dgpp@rank0"
    )
    try:
        before = int(_show(container, "dgpp@rank0", "NRestarts")["NRestarts"])
        container.sh("systemctl kill --signal=SIGSTOP dgpp@rank0")
        frozen = time.monotonic()
        while int(_show(container, "dgpp@rank0", "NRestarts")["NRestarts"]) == before:
            assert time.monotonic() - frozen < 90, _journal(container, "dgpp@rank0")[-3000:]
            time.sleep(0.5)
        while container.sh(HEALTH, check=False).stdout != "200":
            assert time.monotonic() - frozen < 180, _journal(container, "dgpp@rank0")[-3000:]
            time.sleep(0.5)
        TIMINGS["frozen rank 0 serving again (WatchdogSec=6s)"] = time.monotonic() - frozen
        assert "Watchdog timeout" in _journal(container, "dgpp@rank0")
    finally:
        container.sh(f"rm -rf {dropin} && systemctl daemon-reload")


def test_a_world_of_two_heals_when_systemd_restarts_a_worker(container: Container) -> None:
    container.sh(f"cat > /etc/dgpp/deployment.json <<'EOF'\n{_deployment(2)}\nEOF")
    container.sh("systemctl enable dgpp@rank1")  # what a worker's host enables
    _timed(container, "systemctl restart dgpp@rank0 dgpp@rank1", "restart world of 2")
    assert container.sh(HEALTH).stdout == "200"
    assert _show(container, "dgpp@rank1", "StatusText")["StatusText"] == (
        "serving generation 1 as rank 1"
    )

    container.sh("systemctl kill --signal=SIGKILL dgpp@rank1")
    killed, statuses = time.monotonic(), []
    while "generation 2" not in (statuses or [""])[-1]:
        assert time.monotonic() - killed < 120, (statuses, _journal(container, "dgpp@rank0"))
        status = _show(container, "dgpp@rank0", "StatusText")["StatusText"]
        if not statuses or statuses[-1] != status:
            statuses.append(status)
        time.sleep(0.2)
    TIMINGS["world of 2 re-formed after SIGKILL of rank 1"] = time.monotonic() - killed
    print("\nrank 0 status while healing:", *statuses, sep="\n  ")
    assert any(status.startswith("re-forming after") for status in statuses), statuses
    assert container.sh(HEALTH).stdout == "200"
    assert _show(container, "dgpp@rank1", "NRestarts")["NRestarts"] == "1"
    assert "world re-formed" in _journal(container, "dgpp@rank0")


def test_stopping_the_target_is_an_orderly_success(container: Container) -> None:
    # dgpp.target is ordered after the instances it wants, so on a stop it goes first and
    # `systemctl stop dgpp.target` returns at once; the ranks then stop in order (exit 0).
    started = time.monotonic()
    container.sh("systemctl stop dgpp.target")
    units = ("dgpp@rank0", "dgpp@rank1")
    while any(_show(container, unit, "ActiveState")["ActiveState"] != "inactive" for unit in units):
        assert time.monotonic() - started < 90, container.sh("systemctl status 'dgpp@*'").stdout
        time.sleep(0.2)
    TIMINGS["dgpp.target stopped until both ranks inactive"] = time.monotonic() - started
    for unit in units:
        state = _show(container, unit, "Result", "ExecMainStatus")
        assert state == {"Result": "success", "ExecMainStatus": "0"}, (unit, state)


def test_starting_the_target_returns_once_this_machine_serves(container: Container) -> None:
    # ...and the other way round: a target is ordered after the units it wants.
    _timed(container, "systemctl start dgpp.target", "systemctl start dgpp.target (world of 2)")
    assert container.sh(HEALTH).stdout == "200"


def test_tune_ran_and_skipped_the_missing_gpu(container: Container) -> None:
    container.sh("systemctl start dgpp-tune.service")
    assert _show(container, "dgpp-tune", "ActiveState")["ActiveState"] == "active"
    journal = _journal(container, "dgpp-tune")
    assert "GPU clocks: nvidia-smi not found (no NVIDIA driver here); skipped" in journal


def test_side_models_serve_behind_rank_0_and_stop_with_its_unit(container: Container) -> None:
    """Issue 67 in the appliance: rank 0 (a world of one) with a small model under Claude Code's
    haiku alias and an embedder (both the default model), each its own server process in rank
    0's unit; a request by alias and an embedding answer; a side model killed comes back on
    its next request; `systemctl stop` takes every side process with rank 0."""
    container.sh("systemctl stop dgpp.target")
    raw = json.loads(_deployment(1))
    raw["side_models"] = [
        {"name": "fast", "model": MODEL, "aliases": ["claude-3-5-haiku*"], "load": "always",
         "engine": {"kv_capacity": 1024, "num_threads": 1}},
        {"name": "emb", "model": MODEL, "kind": "embed",
         "engine": {"kv_capacity": 1024, "num_threads": 1}},
    ]  # fmt: skip
    container.sh(f"cat > /etc/dgpp/deployment.json <<'EOF'\n{json.dumps(raw)}\nEOF")
    _timed(container, "systemctl start dgpp@rank0", "systemctl start dgpp@rank0 (side models)")
    post = "curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' "
    messages = '{"model": "claude-3-5-haiku-20241022", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}'  # noqa: E501
    assert (
        container.sh(post + f"-d '{messages}' http://127.0.0.1:18080/v1/messages").stdout == "200"
    )
    embed = '{"model": "emb", "input": ["a", "b"]}'
    assert container.sh(post + f"-d '{embed}' http://127.0.0.1:18080/v1/embeddings").stdout == "200"
    cards = json.loads(container.sh("curl -s http://127.0.0.1:18080/v1/models").stdout)["data"]
    states = {card["id"]: (card["state"], card.get("pid")) for card in cards}
    assert states["fast"][0] == "loaded" and states["emb"][0] == "loaded", states
    container.sh(f"kill -9 {states['emb'][1]}")
    time.sleep(2)
    assert container.sh(post + f"-d '{embed}' http://127.0.0.1:18080/v1/embeddings").stdout == "200"
    assert container.sh(HEALTH).stdout == "200"
    main = _show(container, "dgpp@rank0", "MainPID")["MainPID"]
    sides = container.sh("pgrep -f '[d]gpp.appliance.cli serve'").stdout.split()
    parents = {container.sh(f"ps -o ppid= -p {pid}").stdout.strip() for pid in sides}
    assert len(sides) == 2 and parents == {main}, (sides, parents, main)  # rank 0's children
    container.sh("systemctl stop dgpp@rank0")
    left = container.sh("pgrep -f '[d]gpp.appliance.cli serve' || true").stdout.strip()
    assert left == "", left
