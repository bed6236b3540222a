"""Memory plans kept on disk by the console (`plans.cache`), so a console started again finds
them: one JSON file per plan, named by its key. A key holds everything the plan depends on,
`code_stamp` among it, so a stored plan is never stale; the oldest files go beyond
`MAX_STORED`."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from dgpp.webui.plans.memory_preview import MemoryPreview

log = logging.getLogger(__name__)

MAX_STORED = 1024


@functools.cache
def code_stamp() -> str:
    """dgpp's version and the name, size and mtime of every source file of its engine, appliance
    and console: a plan is their function, so an upgrade or an edit makes new keys."""
    import dgpp.appliance
    import dgpp.engine
    import dgpp.webui

    try:
        stamp = [version("dgpp")]
    except PackageNotFoundError:
        stamp = ["unversioned"]
    for package in (dgpp.engine, dgpp.appliance, dgpp.webui):  # namespace packages: __path__
        for root in map(Path, package.__path__):
            for path in sorted(root.rglob("*.py"), key=str):
                info = path.stat()
                stamp.append(f"{path.relative_to(root.parent)}:{info.st_size}:{info.st_mtime_ns}")
    return hashlib.sha256("\n".join(stamp).encode()).hexdigest()


class PlanStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def read(self, key: str) -> MemoryPreview | None:
        """The stored plan under `key`, or None (none, or a file a crash cut short)."""
        try:
            data = json.loads((self.directory / f"{key}.json").read_text())
            return MemoryPreview.from_dict(data)
        except (OSError, ValueError, TypeError):
            return None

    def write(self, key: str, result: MemoryPreview) -> None:
        """Store a plan (atomically); a full or read-only disk only costs the next console
        the time to compute it again."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = self.directory / f".{key}.{threading.get_ident()}.partial"
            partial.write_text(json.dumps(asdict(result)))
            partial.replace(self.directory / f"{key}.json")
            stored = sorted(self.directory.glob("*.json"), key=lambda path: path.stat().st_mtime)
            for old in stored[:-MAX_STORED]:
                old.unlink(missing_ok=True)
        except OSError as err:
            log.warning("cannot store the memory plan of %s: %s", result.model, err)
