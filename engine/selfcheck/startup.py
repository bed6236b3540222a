"""The self-check at a CUDA rank's start, in the model runner's order: the toolchain and the
attention kernels before the model is built (the backend is chosen then), the weights' kernels
once the weights are on the device (before the layers pick theirs), and at warm-up the ranks'
agreement and one graphed decode step against an eager one.

Only where Triton kernels would serve (a CUDA device, Triton installed); `enabled` forces it
elsewhere (the tests, under Triton's interpreter), as does `DGPP_SELFCHECK=force`. `states` is
what `/v1/metrics` shows: `{kernel: "ok" | "fallback: reason"}`, `cuda_graphs` among them once
captured."""

from __future__ import annotations

import logging
import os
from typing import Protocol

import torch
from torch import nn

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ConfigError
from dgpp.engine.selfcheck.allreduce import measure_allreduce
from dgpp.engine.selfcheck.attention_cases import attention_cases
from dgpp.engine.selfcheck.cases import CaseResult, relative_error
from dgpp.engine.selfcheck.results_cache import ResultsCache
from dgpp.engine.selfcheck.run import self_check
from dgpp.engine.selfcheck.weight_cases import weight_cases
from dgpp.kernels import dispatch
from dgpp.kernels.cache_dir import dgpp_cache_dir
from dgpp.kernels.ptxas import choose_ptxas, triton_env_var

log = logging.getLogger("dgpp.selfcheck")


class DecodeGraphsLike(Protocol):  # `dgpp.engine.execution.decode_graphs.DecodeGraphs`
    def replayed_and_eager(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...


CUDA_GRAPHS = "cuda_graphs"
# `off` skips the self-check (to bisect a start), `force` runs it on any device (CPU tensors
# through Triton's interpreter: the tests); unset or `auto`: where Triton kernels would serve.
ENV_VAR = "DGPP_SELFCHECK"
GRAPH_TOLERANCE = 1e-3  # a replay runs the eager step's kernels: equal up to rounding noise


class StartupCheck:
    def __init__(
        self, config: EngineConfig, model: ModelConfig, parallel: ParallelContext,
        device: torch.device, dtype: torch.dtype, enabled: bool | None = None,
        cache: ResultsCache | None = None,
    ) -> None:  # fmt: skip
        self.config, self.model, self.parallel = config, model, parallel
        self.device, self.dtype = device, dtype
        if enabled is None:
            choice = os.environ.get(ENV_VAR, "auto")
            on_gpu = device.type == "cuda" and dispatch.has_triton()
            enabled = choice == "force" or (choice != "off" and on_gpu)
        self.enabled = enabled
        self.cache = cache if cache is not None else ResultsCache(dgpp_cache_dir() / "selfcheck")
        self.states: dict[str, str] = {}
        self.results: list[CaseResult] = []
        self.allreduce: list[dict[str, float]] = []  # measured at warm-up (worlds of 2 or more)

    def _run(self, cases: list) -> None:
        states, results = self_check(cases, self.device, self.cache, self.config.strict_kernels)
        self.states.update(states)
        self.results += results

    def before_build(self) -> None:
        """A fresh start (a new model's), the toolchain, then the attention kernels."""
        dispatch.restore_kernels()
        if not self.enabled:
            return
        if self.device.type == "cuda":
            choose_toolchain(self.device)
        prefill_fp32 = self.config.prefill_precision == "fp32"
        block = self.config.block_size
        where = (self.dtype, prefill_fp32, self.device, self.config.kv_cache_dtype)
        cases = attention_cases(self.model, self.parallel, block, *where)
        self._run(cases)

    def after_load(self, model: nn.Module) -> None:
        """The weights' kernels, on the loaded model."""
        if self.enabled:
            self._run(weight_cases(model, self.model, self.parallel, self.dtype, self.device))

    def agree(self) -> None:
        """Every rank serves the twin of a kernel any rank switched off where the choice is
        made per call; where it was made at build (attention, quantized linears) the ranks may
        differ, which only changes rounding: said in the log. Then the world's all-reduce
        bandwidth is measured (`allreduce`)."""
        self._agree_kernels()
        self.allreduce = measure_allreduce(self.parallel, self.device)
        for each in self.allreduce:
            log.info("all-reduce of %d KiB over %d ranks: %.3f ms, bus %.2f Gbit/s",
                     each["bytes"] >> 10, self.parallel.tp_size, 1e3 * each["seconds"],
                     each["bus_gbps"])  # fmt: skip

    def _agree_kernels(self) -> None:
        failed = self._count(
            [
                kernel not in self.states or self.states[kernel] == "ok"
                for kernel in dispatch.KERNELS
            ]
        )
        size = self.parallel.tp_size
        for kernel, count in zip(dispatch.KERNELS, failed, strict=True):
            own = dispatch.fallbacks().get(kernel)
            if count == 0 or own is not None:
                continue
            log.warning(
                "kernel %s: %d of %d ranks serve its PyTorch twin; so does this one where it can",
                kernel,
                count,
                size,
            )
            dispatch.fall_back(kernel, f"switched off on {count} of {size} ranks")
            self.states[kernel] = f"fallback: switched off on {count} of {size} ranks"

    def _count(self, passed: list[bool]) -> list[int]:
        """How many ranks did not pass, per entry."""
        flags = torch.tensor(
            [0 if ok else 1 for ok in passed], dtype=torch.int32, device=self.device
        )
        return [int(value) for value in self.parallel.all_reduce(flags).tolist()]

    def check_graphs(self, graphs: DecodeGraphsLike) -> DecodeGraphsLike | None:
        """`graphs` (just captured) where they may serve, else None (decode runs eagerly)."""
        compared = graphs.replayed_and_eager() if self.enabled else None
        return graphs if self.graphs_hold(compared) else None

    def graphs_hold(self, compared: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        """Whether decode graphs may serve: the replayed logits equal eager ones on every rank
        (`compared`: this rank's pair, None when nothing was captured)."""
        reason = ""
        if compared is not None:
            error = relative_error(*compared)
            if not error <= GRAPH_TOLERANCE:
                reason = (
                    f"a graphed decode step's logits differ from eager ones (error {error:.3g})"
                )
        failing = self._count([not reason])[0]
        if failing and not reason:
            reason = (
                f"graphed decode differs from eager on {failing} of {self.parallel.tp_size} ranks"
            )
        if reason and self.config.strict_kernels:
            raise ConfigError(f"strict_kernels: {reason}")
        if reason:
            log.warning("CUDA graphs off for this process: %s; decode runs eagerly", reason)
            self.states[CUDA_GRAPHS] = f"fallback: {reason}"
        elif compared is not None:
            self.states[CUDA_GRAPHS] = "ok"
        return not reason


def choose_toolchain(device: torch.device) -> None:
    """On GPUs Triton's bundled ptxas may not know (GB10's sm_121a), point Triton at a CUDA
    toolkit's ptxas that does, unless the operator set Triton's variable
    (`kernels.ptxas.choose_ptxas`)."""
    capability = torch.cuda.get_device_capability(device)
    path, why = choose_ptxas(capability, os.environ)
    if path is not None:
        name = triton_env_var(capability)  # Triton reads its "Blackwell" ptxas from sm_90 up
        os.environ[name] = path
        log.warning("%s=%s: %s", name, path, why)
    elif why:
        log.info("ptxas: %s", why)
