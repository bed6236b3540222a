"""Run the self-check's cases, switch off the kernels that fail, and say so.

Each case's kernel is called once (Triton compiles it there: the time recorded is compile plus
one run) and compared with its twin: ||out - ref|| / ||ref|| within the dtype's tolerance. A
kernel that raises (ptxas cannot target the GPU, shared memory overflows a block) or breaks its
tolerance in any case is switched off for this process (`kernels.dispatch.fall_back`), unless
`strict`: then the rank refuses to start. Results are kept across starts (`ResultsCache`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from dgpp.engine.errors import ConfigError, one_line
from dgpp.engine.selfcheck.cases import Case, CaseResult, dtype_name, first, relative_error
from dgpp.engine.selfcheck.results_cache import ResultsCache, case_key, environment
from dgpp.kernels import dispatch

log = logging.getLogger("dgpp.selfcheck")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: Case, device: torch.device) -> CaseResult:
    """One case, in this process."""
    name, limit = dtype_name(case.dtype), case.limit
    started = time.perf_counter()
    try:
        out = first(case.run())
        _sync(device)
    except Exception as err:  # a compile (ptxas, shared memory) or launch failure
        seconds = time.perf_counter() - started
        failure = f"failed to compile or run: {one_line(err)}"
        return CaseResult(case.kernel, case.label, name, seconds, None, limit, failure)
    seconds = time.perf_counter() - started
    error = relative_error(out, first(case.reference()))
    failure = "" if error <= limit else f"error {error:.3g} above the tolerance {limit:g}"
    return CaseResult(case.kernel, case.label, name, seconds, error, limit, failure)


def run_cases(cases: Iterable[Case], device: torch.device, cache: ResultsCache) -> list[CaseResult]:
    """Every case's result, from `cache` where an earlier start left one; a kernel already
    failed in this run is not run again."""
    env = environment(device)
    results: list[CaseResult] = []
    failed: set[str] = set()
    for case in cases:
        key = case_key(case, env)
        result = cache.load(key)
        if result is None and case.kernel in failed:
            continue
        if result is None:
            cache.mark(key, case)
            result = run_case(case, device)
            cache.store(key, result)
        results.append(result)
        if not result.ok:
            failed.add(case.kernel)
        _log_case(result)
    return results


def _log_case(result: CaseResult) -> None:
    error = "-" if result.error is None else f"{result.error:.2e}"
    where = "cached" if result.cached else f"{result.seconds:.2f} s"
    outcome = "ok" if result.ok else f"FAILED: {result.failure}"
    log.info(
        "self-check %s (%s, %s): error %s, %s: %s",
        result.kernel, result.label, result.dtype, error, where, outcome,
    )  # fmt: skip


def kernel_states(results: Iterable[CaseResult]) -> dict[str, str]:
    """`{kernel: "ok" | "fallback: reason"}` over every case of each kernel."""
    states: dict[str, str] = {}
    for result in results:
        if result.ok:
            states.setdefault(result.kernel, "ok")
        elif not states.get(result.kernel, "").startswith("fallback"):
            states[result.kernel] = f"fallback: {result.failure} ({result.label}, {result.dtype})"
    return states


def apply_results(results: list[CaseResult], strict: bool) -> dict[str, str]:
    """Switch off every kernel that failed a case (or refuse, `strict`); the kernels' states."""
    states = kernel_states(results)
    failed = {kernel: state for kernel, state in states.items() if state != "ok"}
    if failed and strict:
        listed = "; ".join(f"{kernel}: {state}" for kernel, state in failed.items())
        raise ConfigError(
            f"strict_kernels: the self-check failed on this GPU ({listed}). Turn strict_kernels "
            "off to serve these kernels' PyTorch twins instead"
        )
    for kernel, state in failed.items():
        dispatch.fall_back(kernel, state.removeprefix("fallback: "))
        log.warning("kernel %s serves its PyTorch twin in this process: %s", kernel, state)
    return states


def self_check(
    cases: list[Case], device: torch.device, cache: ResultsCache, strict: bool
) -> tuple[dict[str, str], list[CaseResult]]:
    """Run `cases` and apply their results; the kernels' states and every result."""
    started = time.perf_counter()
    results = run_cases(cases, device, cache)
    states = apply_results(results, strict)
    fresh = sum(not result.cached for result in results)
    log.info(
        "self-check: %d kernels, %d cases (%d run, %d cached) in %.2f s; %s",
        len(states), len(results), fresh, len(results) - fresh, time.perf_counter() - started,
        ", ".join(f"{kernel} {state.split(':')[0]}" for kernel, state in states.items()),
    )  # fmt: skip
    return states, results
