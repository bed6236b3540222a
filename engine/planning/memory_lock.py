"""Pins the process's memory (`--mlock`), so the weights and KV pool never swap."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from typing import Protocol

from dgpp.engine.errors import ConfigError


class MlockLibrary(Protocol):
    def mlockall(self, flags: int) -> int: ...


def _mlockall_flags() -> int:
    """MCL_CURRENT | MCL_FUTURE; PowerPC and SPARC number them differently from other Linux."""
    if platform.machine().startswith(("ppc", "sparc")):
        return 0x2000 | 0x4000
    return 1 | 2


def lock_memory(libc: MlockLibrary | None = None) -> None:
    """Pin this process's memory, now and future, so the weights and KV pool never swap.

    `ConfigError` when the kernel refuses: the memlock limit (RLIMIT_MEMLOCK) is too low."""
    if not sys.platform.startswith("linux"):
        raise ConfigError("mlock is supported on Linux only; run without --mlock")
    library: MlockLibrary = libc if libc is not None else ctypes.CDLL(None, use_errno=True)
    if library.mlockall(_mlockall_flags()) == 0:
        return
    code = ctypes.get_errno()
    reason = os.strerror(code) if code else "unknown error"
    advice = (
        "raise the memlock limit: LimitMEMLOCK=infinity in the systemd unit, `ulimit -l "
        "unlimited` in the shell (or memlock in /etc/security/limits.conf), or run without --mlock"
    )
    if code in (errno.EPERM, errno.ENOMEM, errno.EAGAIN):
        raise ConfigError(f"mlockall failed ({reason}): the memlock limit is too low; {advice}")
    raise ConfigError(f"mlockall failed ({reason}); {advice}")
