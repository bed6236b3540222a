"""`dgpp support-bundle`: one deployment's log folder and this host's facts as a .tar.gz that can
be shared: secrets (API keys, tokens, passwords) are redacted from every file it holds."""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from dgpp.appliance.common.paths import log_root, resident_dir
from dgpp.engine.errors import ConfigError

REDACTED = "<redacted>"
_SECRET_KEY = re.compile(r"key|token|secret|password|credential", re.IGNORECASE)
_SECRET_TEXT = (
    re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?(?:bearer|basic)\s+)[^\s\"',]+"),
    re.compile(r"(?i)((?:x-)?api[_-]?key[\"']?\s*[:=]\s*[\"']?)[^\s\"',]+"),
    re.compile(r"(?i)(password[\"']?\s*[:=]\s*[\"']?)[^\s\"',]+"),
    re.compile(r"()\b(?:sk|hf)[-_][A-Za-z0-9_-]{8,}"),
)


def redact_json(value: Any) -> Any:
    """Values under secret-looking keys replaced; a key naming a file (`*_file`) is a path and
    stays."""
    if isinstance(value, dict):
        return {
            key: REDACTED
            if _SECRET_KEY.search(key) and not key.endswith("_file") and value[key] is not None
            else redact_json(value[key])
            for key in value
        }
    if isinstance(value, list):
        return [redact_json(item) for item in value]
    return value


def redact_text(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    for pattern in _SECRET_TEXT:
        text = pattern.sub(lambda match: match.group(1) + REDACTED, text)
    return text


def write_bundle(deployment: str | None, output: Path | None) -> Path:
    """Pack deployment `deployment` (default: the most recently active); the bundle's path."""
    folder = _folder(deployment)
    ident = folder.name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output = output or Path.cwd() / f"dgpp-support-{ident}-{stamp}.tar.gz"
    prefix = f"dgpp-support-{ident}"
    secrets = _known_secrets(folder / "deployment.json")
    with tarfile.open(output, "w:gz") as tar:
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            text = path.read_text(errors="replace")
            if path.suffix == ".json":
                with contextlib.suppress(json.JSONDecodeError):
                    text = json.dumps(redact_json(json.loads(text)), indent=2) + "\n"
            _add(tar, f"{prefix}/{path.name}", redact_text(text, secrets))
        _add(tar, f"{prefix}/host.txt", redact_text(host_facts(), secrets))
    os.chmod(output, 0o600)
    return output


def _folder(deployment: str | None) -> Path:
    root = log_root() / "deployments"
    if deployment is not None:
        folder = root / deployment
        if not folder.is_dir():
            raise ConfigError(f"no log folder for deployment {deployment!r} under {root}")
        return folder
    folders = [p for p in root.glob("*") if p.is_dir()] if root.is_dir() else []
    if not folders:
        raise ConfigError(f"no deployment has logged under {root} yet")
    return max(folders, key=lambda p: max((f.stat().st_mtime for f in p.iterdir()), default=0))


def _known_secrets(deployment_file: Path) -> list[str]:
    """The API key itself, when the deployment names a key file this user can read."""
    try:
        raw = json.loads(deployment_file.read_text())
        key_file = raw.get("http", {}).get("api_key_file")
        key = Path(key_file).read_text().strip() if key_file else ""
    except (OSError, ValueError, AttributeError):
        return []
    return [key] if len(key) >= 4 else []


def host_facts() -> str:
    """Versions, CPU, memory, clocks and resident images: what a bug report needs."""
    from importlib.metadata import PackageNotFoundError, version

    lines = [f"time: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}", f"platform: {platform.platform()}"]
    lines.append(f"python: {platform.python_version()}")
    for package in ("dgpp", "torch", "transformers", "tokenizers", "safetensors", "fastapi"):
        try:
            lines.append(f"{package}: {version(package)}")
        except PackageNotFoundError:
            lines.append(f"{package}: not installed")
    lines.append(f"cpus: {os.cpu_count()}")
    lines += _file_lines("/proc/meminfo", 3)
    governor = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    lines.append(f"cpu0 governor: {governor.read_text().strip() if governor.is_file() else 'n/a'}")
    images = sorted(resident_dir().glob("*.safetensors")) if resident_dir().is_dir() else []
    lines += [f"resident image: {p.name} {p.stat().st_size} bytes" for p in images]
    lines.append("nvidia-smi:")
    lines.append(_command(["nvidia-smi", "-q", "-d", "CLOCK,POWER,TEMPERATURE,PERFORMANCE"]))
    return "\n".join(lines) + "\n"


def _file_lines(path: str, count: int) -> list[str]:
    try:
        return Path(path).read_text().splitlines()[:count]
    except OSError:
        return []


def _command(argv: list[str]) -> str:
    if shutil.which(argv[0]) is None:
        return f"  ({argv[0]} not found)"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"  ({argv[0]} failed: {err})"
    return done.stdout + done.stderr


def _add(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))
