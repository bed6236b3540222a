"""The self-check's results, kept across starts: one JSON file per case under
`<dgpp cache>/selfcheck`, named by a digest of everything the result depends on (the device's
name and compute capability, the driver, PyTorch's and Triton's versions, the source of the
kernel's modules, the case's shape and dtype). A restart on the same node re-checks nothing that
has not changed; a new driver, wheel or kernel source checks again.

A case is marked before it runs and the mark removed after: a kernel that takes the process
down with it (a GPU trap poisons the CUDA context; nothing in-process can recover) leaves its
mark, and the next start switches that kernel off without running it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

from dgpp.engine.selfcheck.cases import Case, CaseResult, dtype_name

MARK_SUFFIX = ".running"


@cache
def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment(device: torch.device) -> dict[str, Any]:
    """What a kernel's behaviour on this node depends on besides its source."""
    found: dict[str, Any] = {
        "device": device.type,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "fla": _version("fla-core"),
    }
    if device.type == "cuda":
        found["name"] = torch.cuda.get_device_name(device)
        found["capability"] = list(torch.cuda.get_device_capability(device))
        found["driver"] = torch._C._cuda_getDriverVersion()
        found["cuda"] = torch.version.cuda
    return found


def source_digest(modules: tuple[str, ...]) -> str:
    """sha256 over the source files of `modules` (a distribution's version where a name is no
    module: "fla")."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name) if "." in name else None
        if spec is not None and spec.origin and Path(spec.origin).is_file():
            digest.update(Path(spec.origin).read_bytes())
        else:
            digest.update(f"{name}=={_version(name + '-core')}".encode())
    return digest.hexdigest()


def case_key(case: Case, env: dict[str, Any]) -> str:
    what = {
        "env": env,
        "kernel": case.kernel,
        "label": case.label,
        "dtype": dtype_name(case.dtype),
        "tolerance": case.limit,
        "source": source_digest(case.sources),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


class ResultsCache:
    """The results of earlier starts (`folder` None: none kept)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    def _path(self, key: str, suffix: str = ".json") -> Path | None:
        return None if self.folder is None else self.folder / f"{key}{suffix}"

    def load(self, key: str) -> CaseResult | None:
        """An earlier start's result; a crash's mark reads as a failure."""
        mark, path = self._path(key, MARK_SUFFIX), self._path(key)
        if mark is not None and mark.exists():
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(mark.stat().st_mtime))
            data = json.loads(mark.read_text() or "{}")
            failure = f"an earlier start ({when}) died running it"
            return CaseResult(**{**data, "failure": failure, "cached": True})
        if path is None or not path.exists():
            return None
        try:
            return CaseResult(**json.loads(path.read_text()), cached=True)
        except (ValueError, TypeError):
            return None  # unreadable: check again

    def mark(self, key: str, case: Case) -> None:
        path = self._path(key, MARK_SUFFIX)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"kernel": case.kernel, "label": case.label, "dtype": dtype_name(case.dtype)}
        path.write_text(
            json.dumps({**entry, "seconds": 0.0, "error": None, "tolerance": case.limit})
        )

    def store(self, key: str, result: CaseResult) -> None:
        path, mark = self._path(key), self._path(key, MARK_SUFFIX)
        if path is None or mark is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(result.to_json()))
        temporary.replace(path)
        mark.unlink(missing_ok=True)
