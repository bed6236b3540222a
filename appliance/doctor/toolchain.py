"""Whether Triton can compile for the node's GPU: its `ptxas` against the device's arch.

On compute capability 12.x (GB10 is 12.1, `sm_121a`) Triton's bundled `ptxas` may not know the
device; the engine then points Triton at a toolkit's `ptxas` at start (`dgpp.kernels.ptxas`), and
this check says so beforehand, for other Triton users of the node too. Without a GPU, or with an
unknown capability, there is nothing to judge.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dgpp.appliance.doctor.check import Check
from dgpp.appliance.doctor.gpu import GpuInventory
from dgpp.kernels.ptxas import can_target, choose_ptxas, ptxas_arch, triton_env_var

NO_PTXAS_FIX = (
    "install a CUDA toolkit of 12.9 or later (its ptxas knows sm_121a) under /usr/local/cuda or "
    "$CUDA_HOME; until then the engine's Triton kernels fall back to their PyTorch twins"
)


def toolchain_checks(inventory: GpuInventory, env: Mapping[str, str]) -> list[Check]:
    if not inventory.gpus:
        return []
    capabilities = sorted({gpu.capability for gpu in inventory.gpus if gpu.capability})
    if not capabilities:
        return [Check("toolchain.ptxas", "unknown", "the GPU's compute capability is unknown")]
    return [_ptxas(capability, env) for capability in capabilities]


def _ptxas(capability: tuple[int, int], env: Mapping[str, str]) -> Check:
    name = "toolchain.ptxas"
    arch = ptxas_arch(capability)
    variable = triton_env_var(capability)
    operator_set = next((v for v in (variable, "TRITON_PTXAS_PATH") if env.get(v)), None)
    if capability[0] == 12 and operator_set is not None:
        ok, said = can_target(Path(env[operator_set]), arch)
        if ok:
            return Check(name, "pass", f"{operator_set}={env[operator_set]} targets {arch}")
        detail = f"{operator_set}={env[operator_set]} cannot target {arch}: {said}"
        fix = f"point {operator_set} at a ptxas of CUDA 12.9 or later, or unset it"
        return Check(name, "warn", detail, fix)
    path, why = choose_ptxas(capability, env)
    if path is not None:
        fix = (
            f"none needed for dgpp: the engine sets {variable}={path} at start; other Triton "
            f"users of this node need {variable}={path} in their environment (the playbook "
            "puts it in the units' environment)"
        )
        return Check(name, "warn", why, fix)
    if why.startswith("no ptxas"):
        return Check(name, "warn", why, NO_PTXAS_FIX)
    return Check(name, "pass", why)
