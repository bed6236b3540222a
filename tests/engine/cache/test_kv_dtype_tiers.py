"""A quantized KV cache through the prefix cache's tiers, a world of two and preemption: the
host and disk tiers keep the quantized rows (paged keys and values, MLA latents) as they are (a
restart's turn hits from disk with the same greedy tokens as a run without tiers, at int8), a
disk tier written at another KV dtype is never read (its layout digest differs even where the
rows' shapes agree: int8 and fp8 of a head of 32), a world of two equals a world of one at
int8, and preempted requests come back on other blocks with the tokens of an unpressed run."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.configuration.engine_config import EngineConfig
from tests.conftest import build_tiny_checkpoint
from tests.engine.cache.test_disk_tier import _stop, _tiers
from tests.engine.cache.test_host_tier import _run, _turns
from tests.engine.distributed import test_tensor_parallel as tp
from tests.engine.family_cases import MOE_DEEPSEEK


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [("LlamaForCausalLM", {}), ("DeepseekV3ForCausalLM", {**MOE_DEEPSEEK, "num_hidden_layers": 2})],
    ids=["paged", "mla-latents"],
)
def test_a_restarts_turn_hits_from_disk_at_int8(
    tmp_path: Path, tokenizer_dir: Path, architecture: str, overrides: dict
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture, **overrides)
    expected, _ = _run(checkpoint, _turns(), kv_cache_dtype="int8")
    folder = tmp_path / "prefix"
    got, first = _run(checkpoint, _turns(), kv_cache_dtype="int8", **_tiers(folder))
    assert got == expected
    assert first.engine.stats().counters.prefix_cache.host_spilled_blocks > 0
    _stop(first)
    got, second = _run(checkpoint, _turns()[2:], kv_cache_dtype="int8", **_tiers(folder))
    assert got == expected[2:]
    cache = second.engine.stats().counters.prefix_cache
    assert cache.hit_tokens == cache.disk_hit_tokens == 48 and cache.disk_failed_blocks == 0
    _stop(second)
    # fp8 rows of Llama's heads (32) have int8's width (34 bytes): only the digest tells.
    got, third = _run(checkpoint, _turns()[2:], kv_cache_dtype="fp8_e4m3", **_tiers(folder))
    assert third.engine.stats().counters.prefix_cache.disk_hit_tokens == 0
    assert len({path.parent.parent for path in folder.rglob("*.kv")}) == 2


def test_world_of_two_equals_world_of_one_at_int8(tmp_path: Path, tokenizer_dir: Path) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    knobs = {**tp.KNOBS, "kv_cache_dtype": "int8"}
    tp._check_world_of_two(checkpoint, knobs, reference_knobs=knobs)


def test_preempted_requests_come_back_with_the_same_tokens_at_int8(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    prompts = [list(range(300 + 40 * i, 330 + 40 * i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def tokens(**knobs: object) -> tuple[list[list[int]], int]:
        llm = LLM(str(checkpoint), block_size=4, kv_cache_dtype="int8", **knobs)
        outputs = llm.generate(prompts, params)
        return [list(o.outputs[0].token_ids) for o in outputs], llm.engine.counters.num_preemptions

    roomy, _ = tokens(kv_capacity=1024)
    pressed, preemptions = tokens(kv_capacity=104, max_model_len=100)
    assert preemptions > 0 and pressed == roomy
    assert EngineConfig(model="x", kv_cache_dtype="int8").kv_cache_dtype == "int8"
