"""On a CUDA machine (marker `gpu`; skipped elsewhere): the Triton kernels compiled, not
interpreted, against their twins at the GPU check's small sizes (`bench/gpu_check_kernels`,
`bench/gpu_check_hybrid`), and CUDA-graph decode against eager on a tiny Llama, Qwen3-MoE and
Qwen3-Next: greedy tokens equal, graphs captured and replayed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from tests.conftest import TINY_QWEN3_NEXT, build_tiny_checkpoint

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[2] / "bench"
CUDA = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def _bench_on_path() -> None:
    sys.path.insert(0, str(BENCH))


def test_every_kernel_equals_its_twin_compiled() -> None:
    from gpu_check_hybrid import gated_delta_kernels
    from gpu_check_kernels import check_kernels

    results = check_kernels(CUDA, dry_run=True, repeats=1)
    results += gated_delta_kernels(CUDA, dry_run=True, repeats=1)
    failed = [(r.name, r.dtype, r.error) for r in results if not r.ok]
    assert not failed, failed


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("LlamaForCausalLM", {}),
        (
            "Qwen3MoeForCausalLM",
            dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
        ),
        ("Qwen3NextForCausalLM", TINY_QWEN3_NEXT),
    ],
)
def test_graphed_decode_equals_eager(
    tmp_path: Path, tokenizer_dir: Path, architecture: str, overrides: dict
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture, **overrides)
    llm = LLM(str(checkpoint), device="cuda", dtype="float32", kv_capacity=1024)
    engine = llm.engine
    engine.warm_up()
    graphs = engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == list(graphs.buckets)
    prompts = [[11 + i, 12, 13 + 2 * i] * (i + 1) for i in range(5)]
    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)
    ]
    graphed = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    replays = graphs.replays
    engine.runner.graphs = None
    eager = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert graphed == eager and replays > 0
