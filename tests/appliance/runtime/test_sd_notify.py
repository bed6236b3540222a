"""The sd_notify protocol against real AF_UNIX datagram sockets (a path and an abstract name),
and what real `dgpp rank` processes tell a service manager as a world forms, serves, loses a
rank, re-forms and stops."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from dgpp.appliance.runtime.sd_notify import Notifier, report_worker
from tests.appliance.world_harness import (
    DgppProcess,
    http_url,
    rendezvous_port,
    start,
    wait_healthy,
    write_deployment,
)
from tests.conftest import build_tiny_checkpoint


class Listener:
    """The service manager's end: a datagram socket that collects every message."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.2)

    def messages(self, wait_s: float = 0.5) -> list[str]:
        received, deadline = [], time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                received.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
        return received

    def wait_for(self, needle: str, timeout_s: float, seen: list[str]) -> str:
        """Collect into `seen` until a message contains `needle`; returns that message."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            seen.append(message)
            if needle in message:
                return message
        raise AssertionError(f"no message with {needle!r} within {timeout_s} s: {seen}")


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    name = f"@dgpp-test-{uuid.uuid4().hex}" if request.param == "abstract" else ""
    listener = Listener(name or str(tmp_path / "notify.sock"))
    yield listener
    listener.sock.close()


def test_ready_status_and_stopping_in_one_datagram(listener: Listener) -> None:
    notifier = Notifier(listener.address)
    assert notifier.notify(ready=True, status="serving m\non 127.0.0.1:8000")
    assert notifier.notify(stopping=True, status="stopping")
    assert listener.messages() == [
        "READY=1\nSTATUS=serving m on 127.0.0.1:8000",  # a newline would end STATUS early
        "STOPPING=1\nSTATUS=stopping",
    ]
    assert notifier.is_ready


def test_status_is_sent_only_when_it_changes(listener: Listener) -> None:
    notifier = Notifier(listener.address)
    for line in ("a", "a", "b", "b", "a"):
        notifier.status(line)
    assert listener.messages() == ["STATUS=a", "STATUS=b", "STATUS=a"]


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    environ: dict[str, str] = {}
    notifier = Notifier.from_environment(environ)
    assert notifier.address is None
    assert not notifier.notify(ready=True, status="serving")
    assert notifier.is_ready  # the state is kept, so the caller needs no branch


def test_from_environment_hides_the_socket_from_children(listener: Listener) -> None:
    environ = {"NOTIFY_SOCKET": listener.address, "PATH": "/bin"}
    notifier = Notifier.from_environment(environ)
    assert notifier.address == listener.address
    assert environ == {"PATH": "/bin"}
    kept = {"NOTIFY_SOCKET": listener.address}
    assert Notifier.from_environment(kept, unset=False).address == listener.address
    assert kept == {"NOTIFY_SOCKET": listener.address}


def test_a_vanished_manager_is_logged_not_raised(tmp_path: Path) -> None:
    assert not Notifier(str(tmp_path / "gone.sock")).notify(status="x")
    assert not Notifier("@dgpp-test-nobody-listens-" + uuid.uuid4().hex).notify(ready=True)


def test_watch_polls_a_description_until_stopped(listener: Listener) -> None:
    state = {"line": "waiting for ranks 1, 2"}
    stop = threading.Event()
    thread = Notifier(listener.address).watch(lambda: state["line"], stop, interval_s=0.05)
    time.sleep(0.2)
    state["line"] = "waiting for ranks 2"
    time.sleep(0.2)
    stop.set()
    thread.join(2)
    assert not thread.is_alive()
    assert listener.messages() == ["STATUS=waiting for ranks 1, 2", "STATUS=waiting for ranks 2"]


def test_keep_alive_pings_at_a_third_of_the_watchdog_until_stopped(listener: Listener) -> None:
    environ = {"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "300000"}
    environ["WATCHDOG_PID"] = str(os.getpid())
    notifier = Notifier.from_environment(environ)
    assert notifier.watchdog_s == 0.3 and environ == {}  # children inherit no watchdog
    stop = threading.Event()
    thread = notifier.keep_alive(stop)
    assert thread is not None
    time.sleep(0.55)  # pings at 0, 0.1, 0.2, ... 0.5 s
    stop.set()
    thread.join(2)
    pings = listener.messages()
    assert set(pings) == {"WATCHDOG=1"} and 4 <= len(pings) <= 7, pings


def test_no_watchdog_no_pings(listener: Listener) -> None:
    stop = threading.Event()
    assert Notifier(listener.address).keep_alive(stop) is None
    other = {"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "300000", "WATCHDOG_PID": "1"}
    assert Notifier.from_environment(other).keep_alive(stop) is None  # meant for another pid
    assert Notifier(None, watchdog_s=1.0).keep_alive(stop) is None  # nobody to tell
    assert listener.messages(0.3) == []


def test_report_worker_follows_a_workers_life(listener: Listener) -> None:
    spec = SimpleNamespace(rank=1, head="10.0.0.1", port=29517)
    worker = SimpleNamespace(spec=spec, generation=None, is_serving=False, ended=None)
    notifier = Notifier(listener.address)
    states = [
        {},
        {"generation": 1},
        {"is_serving": True},
        {"is_serving": True},  # unchanged: nothing sent
        {"generation": None, "is_serving": False, "ended": "lost generation 1: RuntimeError: x"},
        {"generation": 2},
        {"is_serving": True},
    ]
    for change in states:
        vars(worker).update(change)
        report_worker(notifier, worker)  # type: ignore[arg-type]
    assert listener.messages() == [
        "STATUS=waiting for rank 0 at 10.0.0.1:29517",
        "STATUS=joined generation 1; loading the pushed configuration",
        "READY=1\nSTATUS=serving generation 1 as rank 1",
        "STATUS=lost generation 1: RuntimeError: x; waiting for rank 0 at 10.0.0.1:29517",
        "STATUS=joined generation 2; loading the pushed configuration",
        "STATUS=serving generation 2 as rank 1",  # READY only once
    ]


def _stop(process: DgppProcess, sig: int = signal.SIGTERM) -> None:
    if process.process.poll() is None:
        process.process.send_signal(sig)
    process.process.wait(60)


def test_ranks_tell_the_service_manager_where_the_world_stands(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Rank 0 and a worker as `dgpp@rank0` / `dgpp@rank1` run them, each with its own
    NOTIFY_SOCKET; the worker is killed and restarted the way `Restart=always` would."""
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", tokenizer_dir, "Qwen3ForCausalLM")
    deployment = write_deployment(tmp_path / "deployment.json", checkpoint)
    head_socket, worker_socket = (
        Listener(str(tmp_path / "r0.sock")),
        Listener("@" + uuid.uuid4().hex),
    )
    port = rendezvous_port(deployment)
    worker_args = ["rank", "--rank", "1", "--head", "127.0.0.1", "--rendezvous-port", str(port)]
    fast = {"DGPP_CONSUMER_DEADLINE_S": "10"}
    head = start(
        ["rank", "--rank", "0", "--deployment", str(deployment)],
        tmp_path / "rank0.log",
        {**fast, "NOTIFY_SOCKET": head_socket.address},
    )
    worker = start(
        worker_args, tmp_path / "rank1.log", {**fast, "NOTIFY_SOCKET": worker_socket.address}
    )
    head_seen: list[str] = []
    worker_seen: list[str] = []
    try:
        ready = head_socket.wait_for("READY=1", 240, head_seen)
        assert "waiting for ranks 1" in head_seen[0], head_seen
        assert "STATUS=serving m on 127.0.0.1:" in ready and "generation 1)" in ready, ready
        wait_healthy(http_url(deployment), head, timeout=5)  # READY=1 means HTTP answers
        worker_socket.wait_for("READY=1\nSTATUS=serving generation 1 as rank 1", 60, worker_seen)
        assert worker_seen[0].startswith(f"STATUS=waiting for rank 0 at 127.0.0.1:{port}")

        _stop(worker, signal.SIGKILL)
        head_socket.wait_for("STATUS=re-forming after", 60, head_seen)
        worker = start(  # as Restart=always would
            worker_args, tmp_path / "rank1.log", {**fast, "NOTIFY_SOCKET": worker_socket.address}
        )
        again = head_socket.wait_for("STATUS=serving", 120, head_seen)
        assert "READY=1" not in again and "generation 2)" in again, again
        worker_socket.wait_for("READY=1\nSTATUS=serving generation 2 as rank 1", 60, worker_seen)

        _stop(head)
        assert any("STOPPING=1" in message for message in head_socket.messages(1.0))
        left = "STATUS=rank 0 left generation 2 in order; waiting for rank 0 at 127.0.0.1"
        worker_socket.wait_for(left, 30, worker_seen)
        _stop(worker)
        assert worker.process.returncode == 0
        worker_socket.wait_for("STOPPING=1\nSTATUS=stopping with exit code 0", 5, worker_seen)
    finally:
        _stop(worker)
        _stop(head)
        head_socket.sock.close()
        worker_socket.sock.close()
