"""The local backend's end of the sd_notify protocol: what systemd's `WatchdogSec=` does for
`dgpp@rankN`, for the worker ranks `dgpp serve --world N` starts as its children.

Each worker is handed `NOTIFY_SOCKET` (an abstract datagram socket of this process) and
`WATCHDOG_USEC`, so its `Notifier` sends `WATCHDOG=1` at a third of the timeout from a thread of
its own, exactly as under systemd (`appliance/runtime/sd_notify.py`). The kernel stamps every
datagram with its sender's pid (`SO_PASSCRED`), which names the rank. A worker that sends nothing
for the whole timeout is frozen (SIGSTOP, a debugger, a thrashing machine): the supervisor kills it
and starts it again, where the world would otherwise answer `503 re-forming` until it ran again.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import time
from collections.abc import Mapping

from dgpp.engine.errors import ConfigError

# dgpp@.service's WatchdogSec= (tests/appliance/runtime/test_local_watchdog.py keeps them equal).
WATCHDOG_S = 30.0
WATCHDOG_ENV = "DGPP_LOCAL_WATCHDOG_S"  # seconds; 0 turns the local watchdog off
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def watchdog_seconds(environ: Mapping[str, str]) -> float | None:
    """The local watchdog's timeout from `DGPP_LOCAL_WATCHDOG_S` (default `WATCHDOG_S`); None
    when set to 0. A value that is not a non-negative number is a configuration error."""
    text = environ.get(WATCHDOG_ENV, "").strip()
    if not text:
        return WATCHDOG_S
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{WATCHDOG_ENV} must be a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise ConfigError(f"{WATCHDOG_ENV} must be 0 (off) or positive, got {text!r}")
    return value or None


class WatchdogInbox:
    """One abstract datagram socket every worker notifies; remembers when each pid last sent
    `WATCHDOG=1` and the last `STATUS=` line it sent."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.address = f"@dgpp-workers-{os.getpid()}-{secrets.token_hex(6)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind("\0" + self.address[1:])
        self._sock.setblocking(False)
        self._pinged: dict[int, float] = {}
        self.status: dict[int, str] = {}

    def environment(self) -> dict[str, str]:
        """What a worker needs in its environment to feed this watchdog. No `WATCHDOG_PID`:
        the pid is not known before the fork, and the worker takes the variables out of its
        own environment, so no process of its own inherits them."""
        return {"NOTIFY_SOCKET": self.address, "WATCHDOG_USEC": str(int(self.timeout_s * 1e6))}

    def drain(self) -> None:
        """Read every datagram waiting."""
        now = time.monotonic()
        while True:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return
            pid = _sender(ancillary)
            if pid is None:
                continue
            for line in data.decode(errors="replace").splitlines():
                if line == "WATCHDOG=1":
                    self._pinged[pid] = now
                elif line.startswith("STATUS="):
                    self.status[pid] = line.removeprefix("STATUS=")

    def silent_for(self, pid: int) -> float | None:
        """Seconds since `pid` last pinged; None before its first ping (a rank that is still
        starting its interpreter is judged by the world's own deadlines, not this one)."""
        pinged = self._pinged.get(pid)
        return None if pinged is None else time.monotonic() - pinged

    def forget(self, pid: int) -> None:
        self._pinged.pop(pid, None)
        self.status.pop(pid, None)

    def close(self) -> None:
        self._sock.close()


def _sender(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            return int(_UCRED.unpack(payload[: _UCRED.size])[0])
    return None
