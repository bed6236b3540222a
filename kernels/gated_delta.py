"""The gated delta rule behind one call: fla-core's Triton kernels on CUDA, the PyTorch twins of
`gated_delta_torch` elsewhere (and as their reference).

`select_gated_delta(device)` returns a `GatedDeltaFns` whose `chunk` (prefill) and `recurrent`
(decode) take the twins' arguments and give their results: q, k [B, T, H, K], v [B, T, HV, V],
g, beta [B, T, HV], initial_state [B, HV, K, V] or None; out [B, T, HV, V] in v's dtype and the
final state, float32 [B, HV, K, V]. On a CUDA device with `fla.ops.gated_delta_rule` importable
they are thin adapters over fla's `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule`
(always `output_final_state=True`, `use_qk_l2norm_in_kernel=use_qk_l2norm`); otherwise the twins.
`select_kimi_delta(device)` is the same for Kimi Delta Attention (g [B, T, HV, K], a decay per
key channel): fla's `chunk_kda` / `fused_recurrent_kda`, or the twins `chunk_kimi_delta_rule` and
`recurrent_gated_delta_rule`. `DGPP_GATED_DELTA=torch` forces the twins even on CUDA (to bisect
a numerical difference or a Triton failure), as the start-up self-check does for a kernel it
switched off (`kernels.dispatch.fall_back`); unset, empty or `auto` selects as above.

fla-core (pinned to 0.6.0 in pyproject.toml) is imported only for a CUDA device, and may be absent.
Where it imports next to triton, transformers' Qwen3-Next family calls fla's kernels even for CPU
tensors, which then fail (tests/conftest.py hides fla without a GPU for that reason).

The adapters pass q, k, v in v's dtype, g and beta in float32 (both kernels load them as float32)
and everything contiguous. Cases fla's kernels do not cover go to the twins: float64 (the twins
compute in float64 there), T == 0, and K > 256 for the chunk form (fla's limit). fla's chunk
kernel takes chunk sizes 16, 32 and 64 only; any other size runs as 64 (the result is the same
up to rounding). fla's recurrent takes g, gk, gv, beta in that order, so it is called by keyword.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from dgpp.kernels.dispatch import GATED_DELTA, KIMI_DELTA, kernel_on
from dgpp.kernels.gated_delta_torch import (
    chunk_gated_delta_rule,
    chunk_kimi_delta_rule,
    recurrent_gated_delta_rule,
)

ENV_VAR = "DGPP_GATED_DELTA"
FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLA_CHUNK_SIZES = (16, 32, 64)
FLA_CHUNK_MAX_K = 256

Result = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class GatedDeltaFns:
    """Two callables with exactly the signatures of the twins (`fla_chunk` and `fla_recurrent`
    have them too) and the backend's name, "fla" or "torch"."""

    chunk: Callable[..., Result]  # chunk_gated_delta_rule's signature
    recurrent: Callable[..., Result]  # recurrent_gated_delta_rule's signature
    backend: str


TORCH_FNS = GatedDeltaFns(chunk_gated_delta_rule, recurrent_gated_delta_rule, "torch")


@functools.cache
def _fla_ops() -> ModuleType | None:
    try:
        import fla.ops.gated_delta_rule as ops
    except Exception:  # not installed, or no usable triton
        return None
    return ops


@functools.cache
def _fla_kda() -> ModuleType | None:
    try:
        import fla.ops.kda as ops
    except Exception:  # not installed, or no usable triton
        return None
    return ops


def fla_available() -> bool:
    """Whether fla-core's gated delta rule imports here (cached; says nothing about a GPU)."""
    return _fla_ops() is not None


def _fla_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> dict[str, torch.Tensor | None]:
    batch, _, num_v_heads, v_dim = v.shape
    expected = (batch, num_v_heads, k.shape[-1], v_dim)
    assert initial_state is None or initial_state.shape == expected, (initial_state.shape, expected)
    state = None if initial_state is None else initial_state.float().contiguous()
    q, k = (x.to(v.dtype).contiguous() for x in (q, k))
    g, beta = (x.float().contiguous() for x in (g, beta))
    return {"q": q, "k": k, "v": v.contiguous(), "g": g, "beta": beta, "initial_state": state}


def _through_fla(
    kernel: Callable[..., Result] | None,
    twin: Callable[..., Result],
    args: tuple[torch.Tensor, ...],
    initial_state: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
    chunk_size: int | None = None,
    sized: bool = False,
) -> Result:
    """fla's `kernel` on (q, k, v, g, beta) = `args`, or the `twin` where fla does not apply
    (no fla, float64, T == 0, K past the chunk kernel's limit); `chunk_size` for chunk forms,
    passed on to a kernel that takes one (`sized`)."""
    q, k, v, g, beta = args
    chunk = chunk_size is not None
    if (
        kernel is None
        or v.dtype not in FLA_DTYPES
        or q.shape[1] == 0
        or (chunk and k.shape[-1] > FLA_CHUNK_MAX_K)
    ):
        extra = (chunk_size,) if chunk else ()
        return twin(*args, initial_state, scale, use_qk_l2norm, *extra)
    sizes = {"chunk_size": chunk_size if chunk_size in FLA_CHUNK_SIZES else 64} if sized else {}
    out, state = kernel(
        **_fla_inputs(q, k, v, g, beta, initial_state),
        scale=scale,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        **sizes,
    )
    return out.to(v.dtype), state.float()


def _adapter(
    ops: str, kernel: str, twin: Callable[..., Result], sized: bool = False
) -> Callable[..., Result]:
    """`twin` (its signature, its results) on fla's `kernel` from the module `ops` names
    (`_fla_ops` or `_fla_kda`, looked up at each call); `sized`: the kernel takes a chunk size."""
    chunked = "chunk_size" in inspect.signature(twin).parameters  # once, not per call

    @functools.wraps(twin)
    def adapter(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        chunk_size: int | None = None,
    ) -> Result:
        module = globals()[ops]()
        found = None if module is None else getattr(module, kernel)
        if chunk_size is None and chunked:
            chunk_size = 64
        args = (q, k, v, g, beta)
        return _through_fla(
            found, twin, args, initial_state, scale, use_qk_l2norm, chunk_size, sized
        )

    adapter.__doc__ = f"`{twin.__name__}` on fla's `{kernel}`."
    return adapter


fla_recurrent = _adapter("_fla_ops", "fused_recurrent_gated_delta_rule", recurrent_gated_delta_rule)
fla_chunk = _adapter("_fla_ops", "chunk_gated_delta_rule", chunk_gated_delta_rule, sized=True)
FLA_FNS = GatedDeltaFns(fla_chunk, fla_recurrent, "fla")
KDA_TORCH_FNS = GatedDeltaFns(chunk_kimi_delta_rule, recurrent_gated_delta_rule, "torch")
fla_kda_recurrent = _adapter("_fla_kda", "fused_recurrent_kda", recurrent_gated_delta_rule)
fla_kda_chunk = _adapter("_fla_kda", "chunk_kda", chunk_kimi_delta_rule)
FLA_KDA_FNS = GatedDeltaFns(fla_kda_chunk, fla_kda_recurrent, "fla")


def select_gated_delta(device: torch.device) -> GatedDeltaFns:
    """fla's kernels on a CUDA device when fla imports and `DGPP_GATED_DELTA` is not `torch`,
    else the PyTorch twins. fla is imported only for a CUDA device."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice not in ("", "auto", "torch"):
        raise ValueError(f"{ENV_VAR}={choice!r}: expected 'torch' or 'auto'")
    if choice == "torch" or torch.device(device).type != "cuda" or not fla_available():
        return TORCH_FNS
    return FLA_FNS if kernel_on(GATED_DELTA) else TORCH_FNS


def select_kimi_delta(device: torch.device) -> GatedDeltaFns:
    """As `select_gated_delta`, for Kimi Delta Attention (switched off on its own)."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    fla = choice != "torch" and torch.device(device).type == "cuda" and fla_available()
    fla = fla and _fla_kda() is not None and kernel_on(KIMI_DELTA)
    return FLA_KDA_FNS if fla else KDA_TORCH_FNS
