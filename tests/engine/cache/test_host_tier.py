"""The prefix cache's host tier (`dgpp.engine.cache.host_tier`, `dgpp.engine.planning.host_store`):
blocks the KV pool evicts are kept in host memory and loaded back on a later hit. Greedy outputs
equal a run without the tier while its hits replace recomputation (paged KV, MLA latents, and a
hybrid model's blocks with its recurrent-state snapshots; world 1 and world 2); the copies keep
their order."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.cache.host_tier import LOAD, SPILL, HostTier
from tests.conftest import build_tiny_checkpoint

BLOCK = (1, 2, 3, 4)


def test_the_host_tier_keeps_the_newest_blocks_and_records_copies_in_order() -> None:
    tier = HostTier(num_slots=2)
    tier.spill(10, BLOCK, block=5)
    tier.spill(11, BLOCK, block=6)
    assert tier.take_copies() == ((SPILL, 5, 0), (SPILL, 6, 1))
    tier.spill(10, BLOCK, block=7)  # held already: only the newest now, no copy
    assert tier.take_copies() == ()
    tier.spill(12, BLOCK, block=8)  # full: the least recently used (11) gives its slot
    assert tier.take_copies() == ((SPILL, 8, 1),)
    assert tier.find(11, BLOCK) is None and tier.counters.evicted_blocks == 1
    assert tier.find(10, (9, 9, 9, 9)) is None  # a key whose tokens differ is a miss
    slot = tier.find(10, BLOCK)
    assert slot == 0
    tier.load(10, slot, block=3)
    tier.spill(13, BLOCK, block=4)  # 10 was just found: 12 gives its slot, not 10
    assert tier.take_copies() == ((LOAD, 0, 3), (SPILL, 4, 1))
    assert HostTier(0).find(10, BLOCK) is None


def _turns() -> list[list[int]]:
    """A conversation of 40 tokens, another of 60 (its 18 blocks evict most of the first's),
    and the first again, 10 tokens longer."""
    first, second = list(range(100, 140)), list(range(500, 560))
    return [first, second, first + list(range(900, 910))]


def _run(
    checkpoint: Path, turns: list[list[int]] | None = None, **knobs: object
) -> tuple[list[list[int]], LLM]:
    """Greedy outputs of `turns` (`_turns()` by default), one after another, and the LLM.
    20 blocks of 4 tokens: the second conversation evicts the first one's cached blocks."""
    llm = LLM(
        str(checkpoint),
        kv_capacity=80,
        block_size=4,
        prefix_min_tokens=4,
        max_model_len=80,
        **knobs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    turns = _turns() if turns is None else turns
    outputs = [list(llm.generate([turn], params)[0].outputs[0].token_ids) for turn in turns]
    return outputs, llm


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [("LlamaForCausalLM", {}), ("DeepseekV3ForCausalLM", {})],
    ids=["paged-kv", "mla-latents"],
)
def test_a_turn_whose_blocks_were_evicted_hits_the_host_tier(
    tmp_path: Path, tokenizer_dir: Path, architecture: str, overrides: dict[str, object]
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, architecture, **overrides)
    expected, plain = _run(checkpoint)
    got, llm = _run(checkpoint, prefix_cache_host_gib=1e-4)
    assert got == expected
    engine = llm.engine
    assert engine.runner.host is not None and engine.runner.host_slots >= 20
    cache = engine.stats().counters.prefix_cache
    # The first conversation's 10 prompt blocks all hit: those the pool evicted from the host
    # tier, the rest (the oldest, released last) still in the pool; without the tier only those.
    assert cache.hit_tokens == 40 and cache.host_hit_tokens >= 32
    assert cache.host_loaded_blocks * 4 == cache.host_hit_tokens
    assert cache.host_spilled_blocks >= cache.host_loaded_blocks
    off = plain.engine.stats().counters.prefix_cache
    assert off.hit_tokens == 40 - cache.host_hit_tokens and off.host_hit_tokens == 0
    assert engine.block_manager.num_used_blocks == 0


# One device snapshot slot (16,896 bytes each in the tiny Qwen3-Next): the second turn's
# snapshot drops the first's, which only a tier keeps.
HYBRID = {"prefix_cache_gib": 2e-5, "prefix_cache_host_gib": 1e-3}


def test_a_hybrid_models_snapshots_and_blocks_come_back_from_the_host_tier(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Qwen3-Next: its hits need the recurrent-state snapshot at their depth as well as the
    attention layers' blocks. The device keeps one snapshot; the first conversation's goes to
    the host tier with its blocks, and the third turn restores both."""
    checkpoint = build_tiny_checkpoint(
        tmp_path, tokenizer_dir, "Qwen3NextForCausalLM", mlp_only_layers=[1]
    )
    expected, plain = _run(checkpoint, prefix_cache_gib=HYBRID["prefix_cache_gib"])
    got, llm = _run(checkpoint, **HYBRID)
    assert got == expected
    runner = llm.engine.runner
    assert runner.host is not None and runner.host.states is not None
    assert runner.state_host_slots == int(1e-3 * (1 << 30)) // 2 // runner.state_layout.slot_bytes
    cache = llm.engine.stats().counters.prefix_cache
    assert cache.hit_tokens == cache.host_hit_tokens + 8 == 40  # 2 blocks still on the device
    assert plain.engine.stats().counters.prefix_cache.hit_tokens == 0  # its snapshot was gone
    snapshots = llm.engine.block_manager.snapshot_tiers
    assert snapshots is not None and snapshots.host.counters.loaded_blocks == 1


def test_world_of_two_equals_world_of_one_through_the_host_tier(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Each rank spills and loads its own shard, as the step messages say; rank 0 decides the
    hits. Three waves: the third repeats the first, whose blocks the second evicted."""
    from tests.engine.distributed import test_tensor_parallel as tp

    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "Qwen2ForCausalLM")
    first = [list(range(300, 340)), list(range(1000, 1040))]
    second = [list(range(2000, 2040)), list(range(3000, 3040))]
    knobs = {**tp.KNOBS, "kv_capacity": 160, "prefix_min_tokens": 4, "prefix_cache_host_gib": 1e-4}
    hits = tp._check_world_of_two(checkpoint, knobs, waves=(first, second, first))
    assert hits >= 2 * 36  # both prompts of the third wave, from the host tier


def test_world_of_two_equals_world_of_one_for_a_hybrid_model_through_the_tiers(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Qwen3-Next in a world of two: each rank spills and loads its shard of the blocks and of
    the snapshots (ops from STATES), and writes both to disk; the third wave extends the
    first's prompts (a hit needs the snapshot at the end of the earlier prompt), whose blocks
    and snapshots the second pushed out of the device."""
    from tests.engine.distributed import test_tensor_parallel as tp

    checkpoint = build_tiny_checkpoint(
        tmp_path, tokenizer_dir, "Qwen3NextForCausalLM", mlp_only_layers=[1]
    )
    first = [list(range(300, 340)), list(range(1000, 1040))]
    second = [list(range(2000, 2040)), list(range(3000, 3040))]
    knobs = {
        **tp.KNOBS,
        **HYBRID,
        "kv_capacity": 160,
        "prefix_min_tokens": 4,
        # Two device snapshots (a rank's slot is half the world-1 one): the second wave's
        # push the first wave's out, so the third wave's hits restore them from the host tier.
        "prefix_cache_disk_gib": 0.01,
        "prefix_cache_dir": str(tmp_path / "prefix"),
    }
    third = [prompt + [7, 8, 9, 10] for prompt in first]
    hits = tp._check_world_of_two(checkpoint, knobs, waves=(first, second, third))
    assert hits == 2 * 40  # both prompts of the third wave, their snapshots from the host tier
    assert len(list((tmp_path / "prefix").rglob("rank1-states/*.kv"))) >= 4
