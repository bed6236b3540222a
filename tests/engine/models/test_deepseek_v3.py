"""DeepSeek-V3 against transformers on tiny random configs: multi-head latent attention over a
paged latent cache (prefill expanded, decode absorbed) gives transformers' greedy tokens with
and without a query rank, with yarn's mscale correction, rotate-half or interleaved rope, dense
or MoE layers; and through prefix-cache hits, preemption, speculative verify rows and a world of
two ranks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.backends.torch_mla import TorchMLAAttention
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.engine import LLMEngine
from dgpp.engine.layers.mla import LatentAttention
from dgpp.engine.planning.resolved import resolve
from tests.conftest import build_tiny_checkpoint
from tests.engine.distributed.test_tensor_parallel import KNOBS, PRESSURE, _check_world_of_two
from tests.engine.parity import hf_greedy, max_logit_difference

ARCH = "DeepseekV3ForCausalLM"
NEW_TOKENS = 16
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 0.8,  # != mscale_all_dim: the cos/sin tables are scaled too
    "mscale_all_dim": 1.0,  # the softmax scale is multiplied by mscale(4, 1)**2
}
# Two groups of four experts (one kept), a shared expert, a scaling factor: layer 0 dense.
MOE = dict(
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)
CASES = [
    pytest.param({}, id="q-lora"),
    pytest.param({"q_lora_rank": None, "attention_bias": True}, id="no-q-lora-bias"),
    pytest.param({"rope_parameters": YARN}, id="yarn-mscale"),
    pytest.param({"rope_interleave": False}, id="rotate-half"),
    pytest.param(MOE, id="moe"),
]


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    lengths = [1, 5, 13, 40, 70]
    return [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in lengths]


def _params(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _hf(checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def _engine(checkpoint: Path, **knobs: Any) -> LLMEngine:
    options = {"kv_capacity": 2048, "block_size": 4, "prefill_chunk_tokens": 11, **knobs}
    return LLMEngine(resolve(EngineConfig(model=str(checkpoint), seed=0, **options), checkpoint))


def _generate(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int = NEW_TOKENS
) -> list[list[int]]:
    ids = [engine.add_request(prompt, _params(max_tokens)).request_id for prompt in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
    return [done[request_id] for request_id in ids]


@pytest.mark.parametrize("overrides", CASES)
def test_greedy_tokens_match_transformers(
    tmp_path: Path, tokenizer_dir: Path, overrides: dict[str, Any]
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, ARCH, **overrides)
    hf_model = _hf(checkpoint)
    # Small chunks and blocks so prefill chunks and block boundaries fall mid-prompt.
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    runner = llm.engine.runner
    # One latent pool for the three layers: [layers, blocks, block_size, kv_lora_rank + rope].
    assert [tuple(pool.shape) for pool in runner.kv_caches] == [(3, 512, 4, 16 + 8)]
    assert [backend.name for backend in runner.backends] == [TorchMLAAttention.name]
    prompts = _prompts()
    outputs = llm.generate(prompts, _params())  # one batch: prompts of mixed lengths together
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == expected, f"prompt of {len(prompt)} tokens"
        assert len(set(expected)) > 4  # the tiny model is not degenerate
    worst = max(
        max_logit_difference(llm, hf_model, prompt, hf_greedy(hf_model, prompt, 8))
        for prompt in prompts[1:4]
    )
    print(f"DeepSeek-V3 {overrides}: max |logit difference| = {worst:.2e}")
    assert worst < 1e-3
    assert llm.engine.block_manager.num_used_blocks == 0


def test_yarn_softmax_correction_is_needed(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Guards the yarn case: without the mscale**2 softmax correction the logits move well past
    the parity tolerance, so the parity test above does check it."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, ARCH, rope_parameters=YARN)
    hf_model = _hf(checkpoint)
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=256, seed=0)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, LatentAttention)]
    plain = (16 + 8) ** -0.5
    corrected = plain * (0.1 * math.log(4.0) + 1.0) ** 2  # mscale(factor 4, mscale_all_dim 1)
    assert [layer.scale for layer in layers] == [pytest.approx(corrected)] * 3
    prompt = _prompts()[3]
    for layer in layers:
        layer.scale = plain
    assert max_logit_difference(llm, hf_model, prompt, hf_greedy(hf_model, prompt, 4)) > 1e-2


def test_prefix_cache_hits_equal_a_cold_run(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A long shared prefix run twice: the second request starts on the first's cached latent
    blocks (the prefill expands them from the cache) and generates what a cold engine does."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, ARCH)
    prefix = _prompts()[4][:45]
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    cold = _generate(_engine(checkpoint, prefix_cache=False), [first, second])
    engine = _engine(checkpoint, prefix_min_tokens=0)
    warm = _generate(engine, [first]) + _generate(engine, [second])
    assert engine.counters.prefix_cache.hits >= 1
    assert engine.counters.prefix_cache.hit_tokens >= 44  # 11 full blocks of the prefix
    assert warm == cold
    assert warm == [hf_greedy(_hf(checkpoint), prompt, NEW_TOKENS) for prompt in (first, second)]


def test_preemption_recomputes_the_latents(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A pool too small for every request at once: preempted requests are recomputed into other
    blocks and the tokens do not change."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, ARCH)
    prompts = [list(range(300, 340)), [5, 6, 7], list(range(1000, 1013)), [9, 4, 9, 4, 9, 4, 9]]
    engine = _engine(checkpoint, kv_capacity=104, max_model_len=100)
    got = _generate(engine, prompts)
    assert engine.counters.num_preemptions > 0
    hf_model = _hf(checkpoint)
    assert got == [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in prompts]


def test_speculative_verify_rows_decode_absorbed(tmp_path: Path, tokenizer_dir: Path) -> None:
    """N-gram drafts make decode rows of several queries; the absorbed decode of those verify
    rows keeps the greedy tokens, and drafts it accepts leave their latents in the cache."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, ARCH)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 4, 9, 4, 9, 4, 9]]
    engine = _engine(checkpoint, speculative="ngram", spec_ngram_min=1)
    got = _generate(engine, prompts, max_tokens=64)  # long enough for the tiny model to repeat
    assert engine.counters.spec_decode.draft_tokens > 0
    assert engine.counters.spec_decode.accepted_tokens > 0
    hf_model = _hf(checkpoint)
    assert got == [hf_greedy(hf_model, prompt, 64) for prompt in prompts]


def test_multi_token_prediction_layers_are_skipped(tmp_path: Path, tokenizer_dir: Path) -> None:
    """DeepSeek-V3 checkpoints append their MTP layer as `model.layers.{num_hidden_layers}`
    (transformers' save_pretrained writes none): its tensors load into nothing, silently."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, ARCH, num_nextn_predict_layers=1)
    weights_file = checkpoint / "model.safetensors"
    weights = load_file(str(weights_file))
    assert not any(name.startswith("model.layers.3.") for name in weights)
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    weights["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(128, 16)
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    prompt = _prompts()[2]
    got = _generate(_engine(checkpoint), [prompt])
    assert got == [hf_greedy(_hf(checkpoint), prompt, NEW_TOKENS)]


@pytest.mark.parametrize(
    ("overrides", "knobs"),
    [
        pytest.param({}, KNOBS, id="q-lora"),
        # three heads: rank 0 holds two, rank 1 one; o_proj takes the matching input columns
        pytest.param({"q_lora_rank": None, "num_attention_heads": 3}, KNOBS, id="uneven-heads"),
        pytest.param(MOE, PRESSURE, id="moe-preempting"),
    ],
)
def test_world_of_two_equals_world_of_one(
    tmp_path: Path, tokenizer_dir: Path, overrides: dict[str, Any], knobs: dict[str, Any]
) -> None:
    """Heads split across the ranks, the latent cache replicated on both."""
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, ARCH, **overrides)
    _check_world_of_two(checkpoint, knobs)
