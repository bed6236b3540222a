"""What `dgpp doctor` reads of a node: files under a root and the output of tools.

Every read answers a `Reading`: the text, or None with the reason (the file is missing, the tool is
not on PATH, it exited non-zero, it ran past its timeout). Nothing here raises, so a check only
decides what a reading means. `root` is "/" on a node; tests and recorded fixtures point it at a
folder holding the same paths (`<root>/proc/meminfo`, `<root>/sys/...`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Reading:
    text: str | None  # None: nothing was read, `reason` says why
    reason: str = ""

    @property
    def is_read(self) -> bool:
        return self.text is not None


class Probe:
    """Reads a node's files under `root` and runs its tools with `env`'s PATH, each within
    `timeout_s`."""

    def __init__(
        self,
        root: Path | str = "/",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.timeout_s = timeout_s
        self.env = dict(os.environ if env is None else env)

    def path(self, path: str) -> Path:
        """Where the node's absolute `path` lies under the root."""
        return self.root / path.lstrip("/")

    def read(self, path: str) -> Reading:
        try:
            return Reading(self.path(path).read_text(errors="replace"))
        except FileNotFoundError:
            return Reading(None, f"{path} does not exist")
        except OSError as err:
            return Reading(None, f"{path}: {err.strerror or err}")

    def glob(self, pattern: str) -> list[str]:
        """The node's absolute paths matching `pattern` (an absolute glob), sorted."""
        try:
            matches = self.root.glob(pattern.lstrip("/"))
            return sorted("/" + str(match.relative_to(self.root)) for match in matches)
        except (OSError, ValueError):
            return []

    def which(self, tool: str) -> str | None:
        """The tool's path on `env`'s PATH (a path with a slash is taken as given)."""
        if "/" in tool:
            return tool if os.access(tool, os.X_OK) else None
        return shutil.which(tool, path=self.env.get("PATH", os.defpath))

    def run(self, *argv: str, timeout_s: float | None = None) -> Reading:
        """The tool's stdout; None when it is missing, fails or runs past the timeout."""
        tool = self.which(argv[0])
        if tool is None:
            return Reading(None, f"{argv[0]} not found")
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            done = subprocess.run(
                [tool, *argv[1:]],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=limit,
                env=self.env,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return Reading(None, f"{argv[0]} timed out after {limit:g} s")
        except OSError as err:
            return Reading(None, f"{argv[0]}: {err.strerror or err}")
        if done.returncode != 0:
            said = last_line(done.stderr) or last_line(done.stdout)
            reason = f"{argv[0]} exited {done.returncode}"
            return Reading(None, f"{reason}: {said}" if said else reason)
        return Reading(done.stdout)


def last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""
