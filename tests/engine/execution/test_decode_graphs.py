"""Decode graphs (`dgpp.engine.execution.decode_graphs`): which steps and models they serve, and
that a decode through their static, padded buffers gives the eager engine's greedy tokens.

The capture itself needs CUDA (bench/gpu_check.py compares graphed with eager there); here the
same buffers are filled and the forward runs on them directly (`capture=False`), with the
Triton paged-attention kernel interpreted on CPU."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.backends.triton_mla import TritonMLAAttention
from dgpp.engine.backends.triton_paged import TritonPagedAttention
from dgpp.engine.execution.decode_graphs import graph_buckets, why_not_graphed
from dgpp.engine.execution.step_message import StepMessage, StepRow
from dgpp.engine.layers import moe
from dgpp.engine.layers.moe import Experts, PackedExperts
from dgpp.engine.layers.mxfp4_experts import Mxfp4Experts
from dgpp.kernels.fused_moe_triton import fused_moe_triton
from tests.conftest import TINY_QWEN3_NEXT, build_tiny_checkpoint
from tests.kernels.triton_interpret import needs_interpreter

CPU = torch.device("cpu")


def test_buckets_end_at_the_largest_batch() -> None:
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert graph_buckets(10) == (1, 2, 4, 8, 10)
    assert graph_buckets(1) == (1,)


def test_only_graph_safe_backends_and_models_are_captured() -> None:
    dense = torch.nn.Linear(2, 2)
    assert why_not_graphed(dense, [TritonPagedAttention(CPU)]) is None
    assert "torch-paged" in str(why_not_graphed(dense, [TorchPagedAttention(CPU)]))
    assert "2 backends" in str(why_not_graphed(dense, [TritonPagedAttention(CPU)] * 2))
    # Quantized per-expert MLPs count each expert's tokens on the host; so does the stacked
    # experts' PyTorch path (CPU), but not their fused Triton kernel (CUDA weights).
    routed = torch.nn.Sequential(torch.nn.Linear(2, 2), PackedExperts())
    assert "PackedExperts" in str(why_not_graphed(routed, [TritonPagedAttention(CPU)]))
    assert Mxfp4Experts.host_sync
    assert Experts.host_sync.fget(SimpleNamespace(down_proj=torch.zeros(1)))  # CPU weights


def _row(seq: int, start: int, tokens: int) -> StepRow:
    return StepRow(seq, start, (5,) * tokens, 1, 0, (), -1)


def test_only_pure_single_token_decode_steps_fit(tmp_path: Path, tokenizer_dir: Path) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    graphs = LLM(str(checkpoint), kv_capacity=256).engine.runner.attach_decode_graphs(
        4, scratch_block=15, capture=False
    )
    assert graphs.fits(StepMessage(tuple(_row(i, 7, 1) for i in range(4)), num_decodes=4))
    assert not graphs.fits(StepMessage(tuple(_row(i, 7, 1) for i in range(5)), num_decodes=5))
    assert not graphs.fits(StepMessage((_row(0, 7, 3),), num_decodes=1))  # a verify row
    assert not graphs.fits(StepMessage((_row(0, 7, 1), _row(1, 0, 4)), num_decodes=1))
    assert not graphs.fits(StepMessage((_row(0, 7, 1),), num_decodes=1, restores=((0, 1),)))
    assert not graphs.fits(StepMessage((), num_decodes=0))
    assert [graphs.bucket(b) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]


QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
DEEPSEEK_MOE = dict(
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, n_group=2, topk_group=1,
)  # fmt: skip


@needs_interpreter
@pytest.mark.parametrize("family", ["llama", "qwen3-moe", "deepseek-v3", "qwen3-next"])
def test_padded_static_buffers_decode_as_the_eager_engine(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The MoE models' experts run the fused Triton MoE kernel here and DeepSeek-V3's latent
    attention the Triton MLA backend, as on CUDA (interpreted), which is what lets their steps
    be captured; the eager engine runs the PyTorch twins. Qwen3-Next's recurrent layers read
    their state slots from the graphs' buffers (padded rows on a scratch slot)."""
    architecture, overrides = {
        "llama": ("LlamaForCausalLM", {}),
        "qwen3-moe": ("Qwen3MoeForCausalLM", QWEN3_MOE),
        "deepseek-v3": ("DeepseekV3ForCausalLM", DEEPSEEK_MOE),
        "qwen3-next": ("Qwen3NextForCausalLM", TINY_QWEN3_NEXT),
    }[family]
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture, **overrides)
    prompts = [[11, 12, 13], list(range(40, 75)), [7] * 20]  # rows of 1, 3 and 2 blocks
    # Different lengths: the batch shrinks 3 -> 2 -> 1 (buckets 4, 2, 1; padded rows in 4).
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 6, 3)]
    eager = LLM(str(checkpoint), kv_capacity=512, block_size=16)
    expected = [out.outputs[0].token_ids for out in eager.generate(prompts, params)]

    monkeypatch.setattr(
        "dgpp.engine.execution.model_loading.select_backend_for",
        lambda model, *_: (
            TritonMLAAttention(CPU) if model.is_latent_attention else TritonPagedAttention(CPU)
        ),
    )
    monkeypatch.setattr(moe, "fused_moe", fused_moe_triton)
    monkeypatch.setattr(moe, "uses_triton", lambda *_: True)
    graphed = LLM(str(checkpoint), kv_capacity=512, block_size=16)
    runner = graphed.engine.runner
    names = [backend.name for backend in runner.backends]
    assert names in (["triton-paged"], ["triton-mla"], ["triton-paged", "linear-state"])
    assert why_not_graphed(runner.model, runner.backends) is None
    scratch = runner.config.num_kv_blocks - 1  # the pool's last block: never reached here
    slot = runner.state_layout.num_slots - 1  # a snapshot slot: none is taken by short prompts
    graphs = runner.attach_decode_graphs(4, scratch, capture=False, scratch_slot=slot)
    got = [out.outputs[0].token_ids for out in graphed.generate(prompts, params)]
    assert got == expected
    assert graphs.replays == 8  # every decode step after the prompts' own
    assert set(graphs.tables[:, 0].tolist()) != {scratch}  # real tables were written


@needs_interpreter
def test_decode_rows_beside_a_layer_slice_replay_the_graphs(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of decode rows and a long prompt's layer slice
    (`dgpp.engine.scheduling.layer_slices`): the decode rows replay the graphs, the slice runs
    eagerly after them; tokens as the eager engine's, unsliced."""
    from tests.engine.scheduling.test_layer_slices import SliceEveryLongChunk

    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    prompts = [[11, 12, 13], list(range(40, 75)), [7] * 4]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 4, 9)]
    knobs = {"kv_capacity": 512, "block_size": 16, "short_prompt_tokens": 8}
    eager = LLM(str(checkpoint), step_target_ms=-1.0, **knobs)
    expected = [out.outputs[0].token_ids for out in eager.generate(prompts, params)]
    monkeypatch.setattr(
        "dgpp.engine.execution.model_loading.select_backend_for",
        lambda *_: TritonPagedAttention(CPU),
    )
    graphed = LLM(str(checkpoint), **knobs)
    runner = graphed.engine.runner
    graphs = runner.attach_decode_graphs(4, runner.config.num_kv_blocks - 1, capture=False)
    graphed.engine.scheduler.policy = SliceEveryLongChunk(512, 8, num_layers=3, per_step=1)
    steps: list[tuple[int, bool]] = []
    observe = graphed.engine.scheduler.observe

    def record(plan: object, seconds: float) -> None:
        steps.append((plan.num_decodes, any(c.layers for c in plan.chunks)))  # type: ignore[attr-defined]
        observe(plan, seconds)  # type: ignore[arg-type]

    graphed.engine.scheduler.observe = record  # type: ignore[method-assign]
    got = [out.outputs[0].token_ids for out in graphed.generate(prompts, params)]
    assert got == expected
    beside = sum(1 for decodes, sliced in steps if decodes and sliced)
    assert beside >= 2  # the 35-token prompt's three slices beside the short ones' decode rows
    pure = sum(1 for decodes, sliced in steps if decodes and not sliced)
    assert graphs.replays == beside + pure
