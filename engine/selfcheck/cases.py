"""What the self-check runs: one `Case` per kernel and shape (the kernel, its twin as the
reference, the dtype's tolerance), and what it found (`CaseResult`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# ||kernel - twin|| / ||twin|| allowed, by the dtype the kernel ran in; the twin runs in float64
# where it can. A miscompiled kernel is off by order 1, a correct one by its dtype's rounding.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}

Output = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Case:
    kernel: str  # `kernels.dispatch.KERNELS`
    label: str  # the shape, in words: "decode, 2 rows, 8/2 heads of 128, page 16"
    dtype: torch.dtype
    sources: tuple[str, ...]  # the modules whose source the kernel is made of ("dgpp.kernels.x")
    run: Callable[[], Output]  # the kernel
    reference: Callable[[], Output]  # its PyTorch twin on the same inputs (in float64 if it can)
    tolerance: float | None = None  # None: `TOLERANCE[dtype]`

    @property
    def limit(self) -> float:
        return self.tolerance if self.tolerance is not None else TOLERANCE[self.dtype]


@dataclass(frozen=True)
class CaseResult:
    kernel: str
    label: str
    dtype: str
    seconds: float  # the kernel's first call: Triton's compile (or its cache's load) and one run
    error: float | None  # ||out - ref|| / ||ref||; None when the kernel did not run
    tolerance: float
    failure: str = ""  # "" passed; else why the kernel is switched off
    cached: bool = False  # read from the results cache, not run in this process

    @property
    def ok(self) -> bool:
        return not self.failure

    def to_json(self) -> dict[str, object]:
        return {
            "kernel": self.kernel,
            "label": self.label,
            "dtype": self.dtype,
            "seconds": round(self.seconds, 4),
            "error": self.error,
            "tolerance": self.tolerance,
            "failure": self.failure,
        }


def first(out: Output) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64; infinite when `got` is not finite."""
    got, ref = got.double(), ref.double()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    scale = float(ref.norm())
    return float((got - ref).norm()) / (scale if scale > 0 else 1.0)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
