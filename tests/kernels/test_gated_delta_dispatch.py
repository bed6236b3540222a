"""`select_gated_delta`: the PyTorch twins off CUDA and under `DGPP_GATED_DELTA=torch`, fla-core's
kernels on CUDA; the adapters' argument plumbing (against a stand-in for fla); and fla's Triton
kernels, through the adapters, equal the twins under the Triton interpreter on CPU.

The interpreter check runs in a fresh interpreter process (`TRITON_INTERPRET=1` must be set before
triton is imported, see test_group_linear_triton.py), which runs this file again with
`CHILD_ENV` set. Two shims make fla 0.6.0 run under triton 3.9's interpreter there, and only there:

* Triton's autotuner times every config with the active GPU driver, and on CPU there is none
  ("RuntimeError: 0 active drivers ([]). There should only be one."). The child keeps each
  autotuned kernel's first config: configs differ in speed only, not in the values computed.
* The interpreter runs `for i in range(n)` with Python ints, where compiled Triton gives the loop
  variable as an int32 tensor; fla's `chunk_gated_delta_rule_fwd_kernel_h_blockdim64` calls
  `i_t.to(tl.int64)` ("AttributeError: 'int' object has no attribute 'to'"). The child rebinds
  such loop variables through the interpreter's `to_tensor` at the top of the loop body, as
  compiled code sees them.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
from importlib.machinery import PathFinder
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dgpp.kernels.gated_delta as gd
from dgpp.kernels.gated_delta_torch import (
    chunk_gated_delta_rule,
    chunk_kimi_delta_rule,
    recurrent_gated_delta_rule,
)

CHILD_ENV = "DGPP_TEST_FLA_INTERPRETED"
CHILD = os.environ.get(CHILD_ENV) == "1"
CUDA = torch.device("cuda")  # constructing a device needs no GPU


def _inputs(
    seq_len: int,
    seed: int,
    state: bool = True,
    dtype: torch.dtype = torch.float32,
    per_channel: bool = False,
):
    """B=1, H=2, HV=4, K=V=16; keys of norm ~1 so the delta rule is stable without l2norm;
    q built transposed, so it is not contiguous. `per_channel`: g [B, T, HV, K] (KDA)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return {
        "q": rand(1, 2, seq_len, 16).transpose(1, 2),
        "k": rand(1, seq_len, 2, 16) / 4,
        "v": rand(1, seq_len, 4, 16),
        "g": -torch.rand(1, seq_len, 4, *(16,) * per_channel, generator=gen).to(dtype),
        "beta": torch.rand(1, seq_len, 4, generator=gen).to(dtype),
        "initial_state": rand(1, 4, 16, 16) if state else None,
    }


@pytest.fixture
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gd.ENV_VAR, raising=False)


def test_cpu_selects_the_twins_without_importing_fla(no_override, monkeypatch) -> None:
    monkeypatch.setattr(gd, "fla_available", lambda: pytest.fail("fla looked up off CUDA"))
    fns = gd.select_gated_delta(torch.device("cpu"))
    assert fns.chunk is chunk_gated_delta_rule and fns.recurrent is recurrent_gated_delta_rule
    assert fns.backend == "torch"


@pytest.mark.parametrize(
    ("value", "available", "backend"),
    [
        (None, True, "fla"),
        ("auto", True, "fla"),
        ("", True, "fla"),
        ("torch", True, "torch"),
        (" Torch ", True, "torch"),
        (None, False, "torch"),
    ],
)
def test_cuda_selection_and_the_override(monkeypatch, value, available, backend) -> None:
    monkeypatch.setattr(gd, "fla_available", lambda: available)
    if value is None:
        monkeypatch.delenv(gd.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(gd.ENV_VAR, value)
    fns = gd.select_gated_delta(CUDA)
    assert fns.backend == backend
    assert fns is (gd.FLA_FNS if backend == "fla" else gd.TORCH_FNS)


def test_unknown_override_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv(gd.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="DGPP_GATED_DELTA"):
        gd.select_gated_delta(CUDA)


def test_adapters_have_the_twins_signatures() -> None:
    for adapter, twin in (
        (gd.fla_chunk, chunk_gated_delta_rule),
        (gd.fla_recurrent, recurrent_gated_delta_rule),
    ):
        assert inspect.signature(adapter).parameters == inspect.signature(twin).parameters


def _fake_fla(calls: list) -> SimpleNamespace:
    """Stands in for fla.ops.gated_delta_rule: checks what the adapters pass (keywords only, as
    fla's recurrent takes g, gk, gv, beta in that order) and answers with the twins, the state
    returned as fla does (float32), the output in q's dtype as fla's chunk does."""

    def fake(twin, name):
        def call(
            q,
            k,
            v,
            g,
            beta,
            *,
            scale,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            **rest,
        ):
            calls.append((name, rest))
            assert output_final_state is True
            tensors = [q, k, v, g, beta] + ([] if initial_state is None else [initial_state])
            assert all(x.is_contiguous() for x in tensors)
            assert q.dtype == k.dtype == v.dtype and g.dtype == beta.dtype == torch.float32
            assert initial_state is None or initial_state.dtype == torch.float32
            extra = {"chunk_size": rest["chunk_size"]} if name == "chunk" else {}
            out, state = twin(
                q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel, **extra
            )
            return out.to(q.dtype), state

        return call

    return SimpleNamespace(
        chunk_gated_delta_rule=fake(chunk_gated_delta_rule, "chunk"),
        fused_recurrent_gated_delta_rule=fake(recurrent_gated_delta_rule, "recurrent"),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapter_plumbing(monkeypatch, dtype) -> None:
    calls: list = []
    monkeypatch.setattr(gd, "_fla_ops", lambda: _fake_fla(calls))
    args = _inputs(20, seed=1, dtype=dtype)
    args["g"], args["beta"] = args["g"].double(), args["beta"].float()  # mixed, as in models
    for chunk_size, passed in ((16, 16), (64, 64), (100, 64)):
        out, state = gd.fla_chunk(**args, scale=0.3, use_qk_l2norm=True, chunk_size=chunk_size)
        assert calls.pop() == ("chunk", {"chunk_size": passed})
        assert out.dtype == dtype and out.shape == (1, 20, 4, 16)
        assert state.dtype == torch.float32 and state.shape == (1, 4, 16, 16)
    out, state = gd.fla_recurrent(**{**args, "initial_state": None})
    assert calls.pop() == ("recurrent", {}) and out.dtype == dtype
    assert state.dtype == torch.float32 and state.shape == (1, 4, 16, 16)


def test_adapters_use_the_twins_where_fla_does_not_apply(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(gd, "_fla_ops", lambda: _fake_fla(calls))
    double = _inputs(7, seed=2, dtype=torch.float64)
    empty = {name: x if name == "initial_state" else x[:, :0] for name, x in _inputs(7, 3).items()}
    for adapter, twin in (
        (gd.fla_chunk, chunk_gated_delta_rule),
        (gd.fla_recurrent, recurrent_gated_delta_rule),
    ):
        out, state = adapter(**double)
        assert out.dtype == state.dtype == torch.float64  # the twins' float64, not fla's float32
        torch.testing.assert_close((out, state), twin(**double), rtol=0, atol=0)
        out, state = adapter(**empty)  # T == 0
        assert out.shape == (1, 0, 4, 16)
        torch.testing.assert_close(state, empty["initial_state"])
    big_k = {**_inputs(5, seed=4), "initial_state": None}
    big_k["q"], big_k["k"] = torch.randn(1, 5, 2, 320), torch.randn(1, 5, 2, 320)
    gd.fla_chunk(**big_k)  # K > 256: beyond fla's chunk kernel
    assert calls == []


CASES = {  # id: (form, seq_len, initial state, scale, l2norm, chunk_size)
    "recurrent-T20": ("recurrent", 20, True, None, True, None),
    "recurrent-T1-decode": ("recurrent", 1, True, 0.3, False, None),
    "chunk-T20": ("chunk", 20, True, None, True, 64),
    "chunk-T70-c16-no-state": ("chunk", 70, False, 0.3, False, 16),
    "chunk-T70-c64": ("chunk", 70, True, None, True, 64),
    "kda-recurrent-T20": ("kda-recurrent", 20, True, None, True, None),
    "kda-chunk-T70": ("kda-chunk", 70, True, None, True, 64),
    "kda-chunk-T20-no-state": ("kda-chunk", 20, False, 0.3, False, 64),
}


if CHILD:
    if "fla" in sys.modules and sys.modules["fla"] is None:
        del sys.modules["fla"]  # tests/conftest.py blocks fla off CUDA, for transformers' sake

    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import ASTTransformer, InterpretedFunction

    _prune_configs = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs: _prune_configs(self, kwargs)[:1]

    def _visit_for(self: ASTTransformer, node: ast.For) -> ast.AST:
        loop = node.iter
        over_range = isinstance(loop, ast.Call) and isinstance(loop.func, ast.Name)
        if isinstance(node.target, ast.Name) and over_range and loop.func.id == "range":
            name = node.target.id  # `i = i`: visit_Assign makes it `i = to_tensor(i)`
            node.body.insert(
                0, ast.Assign([ast.Name(name, ast.Store())], ast.Name(name, ast.Load()))
            )
        return self.generic_visit(node)

    ASTTransformer.visit_For = _visit_for

    @pytest.mark.parametrize("case", CASES)
    def test_fla_equals_the_twins(case: str) -> None:
        import triton

        assert isinstance(triton.language.zeros, InterpretedFunction), "not interpreting"
        if not gd.fla_available():
            pytest.skip("fla.ops.gated_delta_rule does not import")
        form, seq_len, state, scale, l2norm, chunk_size = CASES[case]
        kda = form.startswith("kda")
        args = {**_inputs(seq_len, seq_len, state, per_channel=kda), "scale": scale}
        args["use_qk_l2norm"] = l2norm
        if form == "kda-chunk":
            got, want = gd.fla_kda_chunk(**args), chunk_kimi_delta_rule(**args)
        elif form == "kda-recurrent":
            got, want = gd.fla_kda_recurrent(**args), recurrent_gated_delta_rule(**args)
        elif form == "chunk":
            got = gd.fla_chunk(**args, chunk_size=chunk_size)
            want = chunk_gated_delta_rule(**args, chunk_size=chunk_size)
        else:
            got, want = gd.fla_recurrent(**args), recurrent_gated_delta_rule(**args)
        assert got[0].dtype == torch.float32 and got[1].shape == (1, 4, 16, 16)
        errors = [(a - b).abs().max().item() for a, b in zip(got, want, strict=True)]
        print(f"{case}: max |out - twin| {errors[0]:.2e}, max |state - twin| {errors[1]:.2e}")
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)

else:

    def test_fla_kernels_equal_the_twins_under_the_interpreter() -> None:
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        if PathFinder.find_spec("fla") is None:  # on sys.path (tests/conftest.py may block it)
            pytest.skip("fla-core is not installed (optional; pip install fla-core==0.6.0)")
        env = {**os.environ, "TRITON_INTERPRET": "1", CHILD_ENV: "1"}
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-s",
                "-n",
                "0",
                "-p",
                "no:cacheprovider",
                __file__,
                "-k",
                "test_fla_equals_the_twins",
            ],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        output = result.stdout[-4000:] + result.stderr[-4000:]
        assert result.returncode == 0, output
        if "skipped" in result.stdout:
            pytest.skip(output[-1000:])
        assert f"{len(CASES)} passed" in result.stdout, output
