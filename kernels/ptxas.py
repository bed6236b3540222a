"""Which `ptxas` Triton should use on a device: its bundled one, or a CUDA toolkit's.

A Triton wheel bundles a `ptxas` that may predate the device: Triton 3.3-3.4's does not know
GB10's `sm_121a`. On compute capability 12.x, when the bundled `ptxas` cannot target the device
and a toolkit's can, Triton must be pointed at the toolkit's through its environment variable,
unless the operator set it. Triton reads `TRITON_PTXAS_PATH`, and from 3.5 on
`TRITON_PTXAS_BLACKWELL_PATH` for capability 9.0 and above (its `ptxas-blackwell`). Everything
here is a pure function of its arguments (the environment arrives as a mapping); probing a
`ptxas` compiles a PTX file of one empty kernel, which takes well under a second.
"""

from __future__ import annotations

import importlib.util
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

PROBE_TIMEOUT_S = 10.0
# The smallest PTX a ptxas assembles, in the first ISA that knows its arch (a newer ptxas reads
# an older ISA; an older one refuses a newer): sm_121a came with ISA 8.8 (CUDA 12.9).
_PTX = (
    ".version {isa}\n.target {arch}\n.address_size 64\n\n"
    ".visible .entry dgpp_probe()\n{{\n\tret;\n}}\n"
)
_FIRST_ISA = {"sm_90": "8.0", "sm_100": "8.6", "sm_120": "8.7"}  # others: 8.8
TOOLKIT_PTXAS = (Path("/usr/local/cuda/bin/ptxas"),)


def ptxas_arch(capability: tuple[int, int]) -> str:
    """The `-arch` of a device: "sm_121a" for 12.1 (the arch-specific "a" from 9.0 on)."""
    major, minor = capability
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def _triton_bin() -> Path | None:
    spec = importlib.util.find_spec("triton")  # located, not imported
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent / "backends" / "nvidia" / "bin"


def bundled_ptxas(capability: tuple[int, int] = (12, 1)) -> Path | None:
    """The `ptxas` the installed Triton runs for a device of `capability`; None without one."""
    folder = _triton_bin()
    if folder is None:
        return None
    blackwell = folder / "ptxas-blackwell"
    if capability >= (9, 0) and blackwell.is_file():
        return blackwell
    plain = folder / "ptxas"
    return plain if plain.is_file() else None


def triton_env_var(capability: tuple[int, int]) -> str:
    """The variable through which the installed Triton takes a `ptxas` for `capability`."""
    folder = _triton_bin()
    has_blackwell = folder is not None and (folder / "ptxas-blackwell").is_file()
    return (
        "TRITON_PTXAS_BLACKWELL_PATH"
        if has_blackwell and capability >= (9, 0)
        else "TRITON_PTXAS_PATH"
    )


def can_target(
    ptxas: Path, arch: str, run: Callable[..., Any] = subprocess.run
) -> tuple[bool, str]:
    """Whether `ptxas` assembles a kernel for `arch` ("sm_121a"), and what it said if not."""
    with tempfile.TemporaryDirectory(prefix="dgpp-ptxas-") as folder:
        source, cubin = Path(folder) / "probe.ptx", Path(folder) / "probe.cubin"
        isa = _FIRST_ISA.get(arch.rstrip("af"), "8.8")
        source.write_text(_PTX.format(isa=isa, arch=arch))
        try:
            done = run(
                [str(ptxas), f"-arch={arch}", "-o", str(cubin), str(source)],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
            )
        except FileNotFoundError:
            return False, f"{ptxas} does not exist"
        except subprocess.TimeoutExpired:
            return False, f"{ptxas} ran past {PROBE_TIMEOUT_S:g} s"
        except OSError as err:
            return False, f"{ptxas}: {err.strerror or err}"
    if done.returncode == 0:
        return True, f"{ptxas} targets {arch}"
    said = [line.strip() for line in f"{done.stderr}\n{done.stdout}".splitlines() if line.strip()]
    return False, said[0] if said else f"{ptxas} exited {done.returncode}"


def toolkit_ptxas(env: Mapping[str, str]) -> list[Path]:
    """CUDA toolkits' `ptxas` in the order tried: $DGPP_CUDA_HOME's (the playbook's), $CUDA_HOME's,
    $CUDA_PATH's, /usr/local/cuda's."""
    homes = [env.get(name) for name in ("DGPP_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")]
    candidates = [Path(home) / "bin" / "ptxas" for home in homes if home]
    return list(dict.fromkeys([*candidates, *TOOLKIT_PTXAS]))


def choose_ptxas(
    capability: tuple[int, int],
    env: Mapping[str, str],
    *,
    bundled: Path | None = None,
    toolkits: Sequence[Path] | None = None,
    run: Callable[..., Any] = subprocess.run,
) -> tuple[str | None, str]:
    """The `ptxas` to set in `triton_env_var(capability)` before Triton's first compile, or None
    (leave the environment as it is), and why. Only capability 12.x is judged; an operator's
    value is never replaced. `bundled` and `toolkits` default to the installed Triton's and
    `toolkit_ptxas(env)`."""
    arch = ptxas_arch(capability)
    if capability[0] != 12:
        return None, f"{arch}: Triton's bundled ptxas serves it"
    for name in (triton_env_var(capability), "TRITON_PTXAS_PATH"):
        if env.get(name):
            return None, f"{name}={env[name]} is set by the operator"
    bundled = bundled if bundled is not None else bundled_ptxas(capability)
    if bundled is None:
        bundled_said = "Triton bundles no ptxas"
    else:
        ok, bundled_said = can_target(bundled, arch, run)
        if ok:
            return None, f"Triton's bundled ptxas targets {arch}"
    tried = []
    for candidate in toolkit_ptxas(env) if toolkits is None else toolkits:
        ok, said = can_target(candidate, arch, run)
        if ok:
            return str(
                candidate
            ), f"Triton's bundled ptxas cannot target {arch} ({bundled_said}); {candidate} can"
        tried.append(said)
    toolkits_said = "; ".join(tried) or "none found"
    return None, f"no ptxas targets {arch}: bundled: {bundled_said}; toolkits: {toolkits_said}"
