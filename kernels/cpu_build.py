"""Building dgpp's small C++ CPU kernels (kernels/cpu/*.cpp) with the system compiler.

Each source is compiled once per machine by `torch.utils.cpp_extension.load` into dgpp's cache
(`kernel_build_dir`),
in a directory and under a module name that carry a hash of the source, the headers beside it, its
path and the torch version: an edited source or header, or another torch, never loads a stale
build, and each checkout keeps its own.
`-march=native` because the build is for this machine only (the cache is per machine); OpenMP
for ATen's parallel_for. `PORTABLE_FLAGS` build the code paths a CPU without AVX2 takes (the
baseline instruction set: SSE2 on x86-64, NEON on Arm), which the tests check on this machine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from dgpp.kernels.cache_dir import dgpp_cache_dir

FLAGS = ("-O3", "-march=native", "-fopenmp")
PORTABLE_FLAGS = ("-O3", "-fopenmp")


def load_cpu_extension(
    source: Path,
    tag: str,
    what: str,
    log: logging.Logger,
    fallback: str,
    flags: tuple[str, ...] = FLAGS,
) -> ModuleType | None:
    """`source` built and imported as `dgpp_<tag>_<digest>`; None, with one warning on `log`
    ("<what> unavailable (<error>); <fallback>"), when it cannot be built. Callers cache it."""
    from torch.utils.cpp_extension import load

    _interpreter_bin_on_path()
    # the headers beside the source are part of it: an edited header rebuilds too
    parts = [source, *sorted(source.parent.glob("*.h"))]
    content = b"".join(part.read_bytes() for part in parts) + torch.__version__.encode()
    if flags != FLAGS:  # another build of the same source
        content += " ".join(flags).encode()
    # and where it lives: PyTorch's builder rebuilds when a build directory's sources move, so
    # two checkouts sharing one directory would rebuild each other's kernel at every switch
    content += str(source.resolve()).encode()
    digest = hashlib.sha256(content).hexdigest()[:12]
    build = kernel_build_dir() / f"{tag}-{digest}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load(
            name=f"dgpp_{tag}_{digest}",
            sources=[str(source)],
            extra_cflags=list(flags),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, a toolchain error: serve slower, not fail
        log.warning("%s unavailable (%s); %s", what, err, fallback)
        return None


def kernel_build_dir() -> Path:
    """Where built kernels live: $DGPP_KERNEL_BUILD_DIR (a shared or writable place when the
    cache is neither), else `kernels` in dgpp's cache directory."""
    configured = os.environ.get("DGPP_KERNEL_BUILD_DIR")
    if configured and Path(configured).is_absolute():
        return Path(configured)
    return dgpp_cache_dir() / "kernels"


def _interpreter_bin_on_path() -> None:
    """PyTorch's builder runs `ninja` from PATH, and pip installs it (a dependency of dgpp) beside
    the interpreter; a service (`dgpp@rankN` under systemd) has no virtual environment on its
    PATH, so without this it never found ninja and served on the slower PyTorch twins."""
    here = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if here not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(part for part in (here, path) if part)
