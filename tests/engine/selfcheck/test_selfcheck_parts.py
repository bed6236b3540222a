"""The self-check's parts: its results cache (keys that follow the kernel's source and the
node's software, a restart that runs nothing, a case that took the process down switched off at
the next start), dispatch choosing the twins on a CUDA device once a kernel is switched off,
the graphs' comparison, and unified memory's sizing and OS floor."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dgpp.engine.backends.selection import select_attention_backend, select_mla_backend
from dgpp.engine.backends.torch_mla import TorchMLAAttention
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.backends.triton_paged import TritonPagedAttention
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ConfigError
from dgpp.engine.planning import device_memory
from dgpp.engine.planning.device_memory import DeviceMemory, drop_page_cache
from dgpp.engine.selfcheck.cases import Case
from dgpp.engine.selfcheck.results_cache import ResultsCache, case_key
from dgpp.engine.selfcheck.run import run_cases
from dgpp.engine.selfcheck.startup import StartupCheck
from dgpp.kernels import dispatch
from dgpp.kernels.rope_store_torch import rope_store

CPU = torch.device("cpu")
GIB = 1 << 30


@pytest.fixture(autouse=True)
def restored() -> None:
    yield
    dispatch.restore_kernels()


def _case(
    sources: tuple[str, ...] = ("dgpp.kernels.rms_norm_triton",), calls: list | None = None
) -> Case:
    def run() -> torch.Tensor:
        if calls is not None:
            calls.append(1)
        return torch.ones(3)

    return Case(dispatch.RMS_NORM, "3", torch.float32, sources, run, lambda: torch.ones(3))


def test_the_key_follows_the_kernels_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "fakekernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = package / "norm.py"
    source.write_text("def kernel():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = {"device": "cuda", "name": "NVIDIA GB10", "capability": [12, 1], "triton": "3.9.0"}
    case = _case(("fakekernels.norm",))
    first = case_key(case, env)
    assert case_key(case, env) == first
    source.write_text("def kernel():\n    return 2\n")
    assert case_key(case, env) != first
    assert case_key(case, {**env, "driver": 13000}) != case_key(case, env)
    assert case_key(replace(case, dtype=torch.bfloat16), env) != case_key(case, env)
    sys.modules.pop("fakekernels", None)


def test_a_restart_runs_no_case_again(tmp_path: Path) -> None:
    cache, calls = ResultsCache(tmp_path), []
    assert run_cases([_case(calls=calls)], CPU, cache)[0].ok
    again = run_cases([_case(calls=calls)], CPU, cache)
    assert len(calls) == 1 and again[0].cached and again[0].ok


def test_a_case_that_took_the_process_down_is_off_at_the_next_start(tmp_path: Path) -> None:
    cache, calls = ResultsCache(tmp_path), []
    case = _case(calls=calls)
    from dgpp.engine.selfcheck.results_cache import environment

    cache.mark(case_key(case, environment(CPU)), case)  # the start died inside the case
    result = run_cases([case], CPU, cache)[0]
    assert not calls and not result.ok and "died running it" in result.failure


def test_dispatch_serves_the_twins_on_cuda_once_switched_off() -> None:
    cuda = torch.device("cuda")  # backends are only constructed: no GPU is touched
    assert isinstance(select_attention_backend(cuda, torch.bfloat16), TritonPagedAttention)
    dispatch.fall_back(dispatch.ROPE_STORE, "test")
    backend = select_attention_backend(cuda, torch.bfloat16)
    assert isinstance(backend, TritonPagedAttention) and backend.rotate_and_store is rope_store
    dispatch.fall_back(dispatch.PAGED_ATTENTION, "test")
    dispatch.fall_back(dispatch.MLA_DECODE, "test")
    assert type(select_attention_backend(cuda, torch.bfloat16)) is TorchPagedAttention
    assert type(select_mla_backend(cuda, torch.bfloat16)) is TorchMLAAttention
    dispatch.restore_kernels()
    assert not dispatch.fallbacks()


def _check(strict: bool = False) -> StartupCheck:
    config = EngineConfig(model="x", strict_kernels=strict)
    return StartupCheck(config, None, ParallelContext(), CPU, torch.float32, enabled=True)  # type: ignore[arg-type]


def test_graphs_go_off_when_their_logits_differ_from_eager_ones() -> None:
    logits = torch.randn(1, 64)
    check = _check()
    assert check.graphs_hold((logits, logits.clone())) and check.states["cuda_graphs"] == "ok"
    check = _check()
    assert not check.graphs_hold((logits, logits + 1))
    assert check.states["cuda_graphs"].startswith("fallback: a graphed decode step's logits")
    assert not _check().graphs_hold((logits * float("nan"), logits))
    with pytest.raises(ConfigError, match="strict_kernels"):
        _check(strict=True).graphs_hold((logits, -logits))


def test_unified_memory_sizes_from_memavailable_and_keeps_the_os_floor(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A GB10 as CUDA reports it (a stand-in for the GPU this machine lacks): integrated, and
    `cudaMemGetInfo` would say MemFree; /proc/meminfo of a Spark holding 60 GiB of page cache."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 125000000 kB\nMemFree: 50000000 kB\nMemAvailable: 115000000 kB\n")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA GB10")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: type("P", (), {"is_integrated": True})()
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: pytest.fail("reads MemFree"))
    host = device_memory.read_host_memory
    monkeypatch.setattr(device_memory, "read_host_memory", lambda: host(meminfo))
    memory = device_memory.read_device_memory("cuda", 6 * GIB)
    assert memory.free_bytes == 115000000 * 1024 and "unified memory" in memory.description
    assert memory.budget(None) == int(memory.total_bytes * 0.9) - (
        memory.total_bytes - memory.free_bytes
    )
    assert memory.budget(1.0) == memory.free_bytes - 6 * GIB  # the floor binds
    tight = DeviceMemory(20 * GIB, 8 * GIB, "gb10", True, reserve_bytes=6 * GIB)
    assert tight.budget(1.0) == 2 * GIB


def test_dropping_the_page_cache_says_what_happened(tmp_path: Path) -> None:
    control = tmp_path / "drop_caches"
    assert drop_page_cache(control) == "dropped the page cache" and control.read_text() == "1\n"
    said = drop_page_cache(tmp_path / "missing" / "drop_caches")
    assert "could not drop the page cache" in said and "root" in said
