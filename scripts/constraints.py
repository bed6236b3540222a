"""The lock: `constraints.txt`, the exact versions of every package the test suite passed with.

    python scripts/constraints.py write [FILE]      the current environment's versions -> FILE
    python scripts/constraints.py effective [FILE]  FILE as pip should apply it here (stdout)
    python scripts/constraints.py diff [FILE]       what this environment holds that FILE does not

`scripts/install.sh` installs under the lock by default (`--latest` ignores it), so a fresh
machine runs what CI ran, and an upgrade is a deliberate step: install with `--latest`, run the
suite, then `write` the new lock and commit it.

torch's build is never locked: the CPU build here, the user's own CUDA build elsewhere. Nor is
what that build pins exactly (a CUDA build's `triton==X`, `nvidia-*==Y`): those belong to the
build, so `effective` drops them from the lock when the installed torch asks for them.
Run it with the environment's own Python (it reads that environment's installed packages).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
# Never locked: the project itself, the installer, and torch's build (see above).
UNLOCKED = {"dgpp", "pip", "torch"}


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_exact_pins() -> set[str]:
    """Packages the installed torch requires at one exact version (its build's companions)."""
    try:
        requirements = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        return set()
    pins = set()
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        if "extra ==" in marker:
            continue
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*==", spec)
        if match:
            pins.add(canonical(match.group(1)))
    return pins


def lock_lines() -> list[str]:
    """`name==version` for every installed distribution that the lock covers, sorted."""
    skip = UNLOCKED | torch_exact_pins()
    versions = {
        canonical(dist.metadata["Name"]): dist.version
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"]
    }
    return [f"{name}=={versions[name]}" for name in sorted(versions) if name not in skip]


def write(path: Path) -> None:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "absent"
    header = [
        "# dgpp's lock: the exact versions the test suite passed with (pip constraints).",
        "# Written by `python scripts/constraints.py write`; scripts/install.sh applies it unless",
        "# given --latest. torch's build is not locked, nor what that build pins exactly.",
        f"# Written {datetime.date.today().isoformat()} on Python {platform.python_version()}"
        f" ({platform.machine()}), beside torch {torch_version}.",
    ]
    path.write_text("\n".join([*header, *lock_lines()]) + "\n")


def effective(path: Path) -> str:
    """The lock's lines that apply beside the installed torch (comments kept)."""
    skip = UNLOCKED | torch_exact_pins()
    kept = []
    for line in path.read_text().splitlines():
        name = line.split("==", 1)[0].strip()
        if line.startswith("#") or not name or canonical(name) not in skip:
            kept.append(line)
    return "\n".join(kept) + "\n"


def pins(lines: list[str]) -> dict[str, str]:
    """`{name: version}` of a lock's `name==version` lines."""
    return {
        canonical(name): version
        for line in lines
        if not line.startswith("#") and "==" in line
        for name, version in [line.split("==", 1)]
    }


def diff(path: Path) -> list[str]:
    """One line per package whose installed version is not the lock's (moved, added, gone)."""
    locked = pins(path.read_text().splitlines())
    skip = UNLOCKED | torch_exact_pins()
    locked = {name: version for name, version in locked.items() if name not in skip}
    installed = pins(lock_lines())
    return [
        f"{name}: {locked.get(name, '-')} -> {installed.get(name, '-')}"
        for name in sorted(locked.keys() | installed.keys())
        if locked.get(name) != installed.get(name)
    ]


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] not in ("write", "effective", "diff"):
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[1]) if len(argv) == 2 else LOCK
    if argv[0] == "write":
        write(path)
    elif argv[0] == "effective":
        sys.stdout.write(effective(path))
    else:
        moved = diff(path)
        print(f"{len(moved)} package(s) differ from {path.name} (locked -> installed)")
        print("\n".join(moved), end="\n" if moved else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
