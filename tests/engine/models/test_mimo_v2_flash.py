"""MiMo-V2-Flash against transformers on tiny random configs: windowed layers with twice the key
heads, sinks and their own rotary base beside full ones, value heads narrower than key heads
and scaled, partial rotary, a dense first layer before routed experts. Greedy tokens of a mixed
batch whose prompts run past the window, in prefill chunks over block boundaries; the logits; a
prefix-cache hit; preemption; world 2 equal to world 1; and the release's own config.json
spelling read as transformers' is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.backends.cache_spec import PagedKVSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.window_kv import WindowStateSpec
from dgpp.engine.models.mimo_v2_flash import MimoLayout, MiMoV2FlashForCausalLM
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import check_batch_matches_transformers, check_snapshot_hits

NEW = 12
WINDOW = 6
TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
ROPE = {"rope_type": "default", "partial_rotary_factor": 0.334}
TINY = dict(
    num_hidden_layers=4,
    head_dim=48,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=2,
    topk_group=1,
    sliding_window=WINDOW,
    attention_value_scale=0.707,
    layer_types=TYPES,
    rope_parameters={
        "full_attention": {**ROPE, "rope_theta": 500000.0},
        "sliding_attention": {**ROPE, "rope_theta": 10000.0},
    },
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("mimo-v2-flash")
    return build_tiny_checkpoint(out, tokenizer_dir, "MiMoV2FlashForCausalLM", **TINY)


def _greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in (1, 5, 13, 40)]


def test_greedy_tokens_and_logits_match_transformers(checkpoint: Path) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    prompts = _prompts()
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    check_batch_matches_transformers(llm, hf_model, prompts, NEW)


def test_prefix_hits_restore_the_window_and_continue(checkpoint: Path) -> None:
    """The windowed layers' states are snapshotted as a recurrent layer's: where prompts
    branch (the third prompt restores what the second saved) and after a prompt's last full
    block (a conversation's next turn); both hits give transformers' tokens."""
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    check_snapshot_hits(checkpoint, hf_model)


def test_long_chunks_attend_in_query_blocks(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk's queries attend in blocks (each over the keys its window reaches); blocks
    smaller than the window and than the chunk give one whole chunk's tokens."""
    import dgpp.engine.layers.window_kv as window_kv

    prompts = _prompts()
    whole = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=64, seed=0)
    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, _greedy())]
    monkeypatch.setattr(window_kv, "QUERY_BLOCK", 3)
    blocked = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=64, seed=0)
    assert [o.outputs[0].token_ids for o in blocked.generate(prompts, _greedy())] == expected


def test_preempted_requests_resume_to_the_same_tokens(checkpoint: Path) -> None:
    """A cache too small for the batch preempts and recomputes; the tokens stay the same."""
    prompts = _prompts()
    roomy = LLM(str(checkpoint), block_size=4, kv_capacity=2048, seed=0)
    tight = LLM(str(checkpoint), block_size=4, kv_capacity=80, prefill_chunk_tokens=8, seed=0)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, _greedy(20))]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, _greedy(20))]
    assert got == expected
    assert tight.engine.counters.num_preemptions > 0


def test_world_of_two_equals_world_of_one(checkpoint: Path) -> None:
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    _check_world_of_two(checkpoint, KNOBS)


def _release_spelling(source: Path, out: Path) -> Path:
    """The checkpoint with the config keys of Xiaomi's release, and the sinks under
    transformers' in-memory name (transformers saves them under the release's)."""
    shutil.copytree(source, out)
    config = json.loads((source / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "sliding_window"):
        config.pop(key)
    config.update(
        hybrid_layer_pattern=[int(kind == "sliding_attention") for kind in TYPES],
        moe_layer_freq=[0, 1, 1, 1],
        rope_theta=500000.0,
        swa_rope_theta=10000.0,
        partial_rotary_factor=0.334,
        sliding_window_size=WINDOW - 1,
        swa_num_key_value_heads=2 * config["num_key_value_heads"],
        swa_head_dim=config["head_dim"],
        swa_v_head_dim=config["v_head_dim"],
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
        layernorm_epsilon=config.pop("rms_norm_eps"),
    )
    (out / "config.json").write_text(json.dumps(config))
    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        renamed = {k.replace(".attention_sink_bias", ".sinks"): v for k, v in tensors.items()}
        assert renamed != tensors
        renamed["model.mtp.layers.0.input_layernorm.weight"] = torch.ones(4)  # skipped
        save_file(renamed, str(file), metadata={"format": "pt"})
    return out


def test_the_release_spelling_serves_the_same_tokens(checkpoint: Path, tmp_path: Path) -> None:
    release = _release_spelling(checkpoint, tmp_path / "release")
    config = ModelConfig.from_checkpoint(release)
    layout = MimoLayout.of(config)
    assert layout.window == WINDOW and layout.dense_layers == {0}
    assert layout == MimoLayout.of(ModelConfig.from_checkpoint(checkpoint))
    assert config.rotary_dim == 16 and config.rope.theta == 500000.0
    prompts = _prompts()
    ours = LLM(str(checkpoint), block_size=4, seed=0).generate(prompts, _greedy())
    theirs = LLM(str(release), block_size=4, seed=0).generate(prompts, _greedy())
    assert [o.outputs[0].token_ids for o in theirs] == [o.outputs[0].token_ids for o in ours]


def test_cache_and_state_specs_by_layer_kind(checkpoint: Path) -> None:
    """Full layers page their keys and values (values padded to the keys' width); windowed
    layers, with twice the key heads, keep the last window - 1 as a state."""
    check_specs(checkpoint, page_width=48, value_width=32)


def check_specs(checkpoint: Path, page_width: int, value_width: int) -> None:
    """The paged full layers at `page_width` (keys and values alike), the windowed states with
    48-wide keys and `value_width` values, at world 1 and 2 (the full layers' 2 KV heads, the
    windowed layers' 4, split between the ranks)."""
    config = ModelConfig.from_checkpoint(checkpoint)
    for tp_size, full_heads, window_heads in ((1, 2, 4), (2, 1, 2)):
        parallel = ParallelContext(tp_rank=tp_size - 1, tp_size=tp_size)
        specs = MiMoV2FlashForCausalLM.cache_specs(config, parallel)
        assert specs == [PagedKVSpec(full_heads, page_width)] * 2
        states = MiMoV2FlashForCausalLM.state_specs(config, parallel)
        assert states == [WindowStateSpec(window_heads, 48, value_width, WINDOW - 1)] * 2
