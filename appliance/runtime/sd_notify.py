"""systemd's readiness protocol (sd_notify(3)) for `Type=notify` units, without libsystemd.

The service manager passes a datagram socket in `NOTIFY_SOCKET` (a path, or an abstract name
written with a leading `@`); a rank sends newline-separated `KEY=value` assignments to it:
`READY=1` once it serves, `STATUS=...` (the line `systemctl status` shows) and `STOPPING=1` on an
orderly stop. Without `NOTIFY_SOCKET` (a shell) every call is a no-op, so the ranks need no "am
I under systemd" branch; the local backend's workers notify `dgpp serve` itself
(`appliance/runtime/local_watchdog.py`).

With `WatchdogSec=` the manager also passes `WATCHDOG_USEC`; the rank then sends `WATCHDOG=1` at
a third of it from a thread of its own. A rank that is frozen (SIGSTOP, a debugger, a machine
thrashing) sends nothing, and systemd kills and restarts it, where the world would otherwise wait
for it forever: dgpp's own deadlines notice a silent rank, but only a restart brings it back.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dgpp.engine.distributed.worker import Worker

log = logging.getLogger(__name__)


class Notifier:
    """Sends notifications to one socket address (None: to nobody)."""

    def __init__(self, address: str | None, watchdog_s: float | None = None) -> None:
        self.address = address or None
        # The manager's watchdog timeout (WatchdogSec=), None when it watches nothing.
        self.watchdog_s = watchdog_s if self.address else None
        self.last_status: str | None = None
        self.is_ready = False
        self._lock = threading.Lock()

    @classmethod
    def from_environment(
        cls, environ: MutableMapping[str, str] | None = None, unset: bool = True
    ) -> Notifier:
        """The socket systemd gave this process. `unset` removes `NOTIFY_SOCKET` from the
        environment, so that child processes (the local backend's workers) do not inherit it:
        with `NotifyAccess=main` systemd would log every message they sent as refused."""
        env = os.environ if environ is None else environ
        take = env.pop if unset else env.get
        address = take("NOTIFY_SOCKET", None)
        usec, pid = take("WATCHDOG_USEC", None), take("WATCHDOG_PID", None)
        watched = usec is not None and usec.isdigit() and int(usec) > 0
        if watched and pid is not None and pid != str(os.getpid()):
            watched = False  # the variables were meant for another process (sd_watchdog_enabled)
        return cls(address, int(usec) / 1e6 if watched and usec else None)

    def notify(
        self, ready: bool = False, status: str | None = None, stopping: bool = False
    ) -> bool:
        """Send the given states in one datagram; True when it was sent. Never raises: a
        supervisor that cannot be told must not stop the rank from serving."""
        lines = []
        if ready:
            lines.append("READY=1")
        if stopping:
            lines.append("STOPPING=1")
        if status is not None:
            # One line per assignment: a newline would end the STATUS value early.
            lines.append("STATUS=" + " ".join(status.split()))
        with self._lock:
            if status is not None:
                self.last_status = status
            self.is_ready = self.is_ready or ready
            if self.address is None or not lines:
                return False
            return _send(self.address, "\n".join(lines).encode())

    def status(self, line: str) -> bool:
        """Send STATUS=line unless it is the line sent last."""
        if line == self.last_status:
            return False
        return self.notify(status=line)

    def watch(
        self, describe: Callable[[], str], stop: threading.Event, interval_s: float = 0.5
    ) -> threading.Thread:
        """Poll `describe()` every `interval_s` on a daemon thread and send each new line as
        STATUS until `stop` is set: shows the progress of calls that block for minutes
        (forming a world, loading weights) without threading a callback through the engine."""

        def loop() -> None:
            while True:
                try:
                    self.status(describe())
                except Exception:  # a status line is never worth a crash
                    log.debug("cannot describe the status", exc_info=True)
                if stop.wait(interval_s):
                    return

        thread = threading.Thread(target=loop, name="dgpp-sd-notify", daemon=True)
        thread.start()
        return thread

    def keep_alive(self, stop: threading.Event) -> threading.Thread | None:
        """Send WATCHDOG=1 every third of the watchdog timeout until `stop` is set, on a daemon
        thread; None (nothing started) when the manager set no watchdog."""
        if self.watchdog_s is None or self.address is None:
            return None
        address, every_s = self.address, self.watchdog_s / 3

        def loop() -> None:
            while True:
                _send(address, b"WATCHDOG=1")
                if stop.wait(every_s):
                    return

        thread = threading.Thread(target=loop, name="dgpp-sd-watchdog", daemon=True)
        thread.start()
        return thread


def _send(address: str, message: bytes) -> bool:
    # An abstract socket's name starts with a NUL byte, which the environment cannot hold.
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, target)
    except OSError as err:
        log.warning("cannot notify the service manager at %s: %s", address, err)
        return False
    return True


def report_worker(notifier: Notifier, worker: Worker) -> None:
    """Tell the service manager where a worker rank stands (polled by its main loop): READY=1
    the first time it serves, then one STATUS line per change."""
    spec = worker.spec
    waiting = f"waiting for rank 0 at {spec.head}:{spec.port}"
    if worker.generation is None:
        line = f"{worker.ended}; {waiting}" if worker.ended else waiting
    elif worker.is_serving:
        line = f"serving generation {worker.generation} as rank {spec.rank}"
    else:
        line = f"joined generation {worker.generation}; loading the pushed configuration"
    if worker.is_serving and not notifier.is_ready:
        notifier.notify(ready=True, status=line)
    else:
        notifier.status(line)
