"""DeepSeek-V4 against transformers on tiny random configs: sliding, compressed sparse (an
indexer choosing fewer keys than the prompts close) and heavily compressed layers, two mHC
streams, hash-routed and scored experts. Greedy tokens and logits of a mixed batch whose prompts
run past the window and the sparse budget, in prefill chunks over block and window boundaries;
the paged compressed keys equal transformers' cache after prefill and decode; prefix-cache hits;
preemption; world 2; the release's own names and config spelling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.errors import ConfigError
from dgpp.engine.layers.compressed_keys import CompressedKeys, CompressedKeySpec
from dgpp.engine.layers.v4_config import V4Dims, v4_ropes
from dgpp.engine.layers.v4_state import CarrySpec, V4StateSpec
from dgpp.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import (
    check_batch_matches_transformers,
    check_snapshot_hits,
    random_prompts,
)

NEW = 12
TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]
# Rates 2 and 4 so that blocks of 4 (the suites' shared knobs) hold two keys and one.
TINY = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    intermediate_size=32,
    head_dim=32,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    sliding_window=6,
    layer_types=TYPES,
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    index_n_heads=16,  # enough that the ReLU scores do not tie (ties break either way)
    index_head_dim=16,
    index_topk=3,
    hc_mult=2,
    num_hash_layers=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    swiglu_limit=1.0,  # small enough that the clamps act
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("deepseek-v4")
    return build_tiny_checkpoint(out, tokenizer_dir, "DeepseekV4ForCausalLM", **TINY)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def _greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts() -> list[list[int]]:
    return random_prompts(5)


def test_greedy_tokens_and_logits_match_transformers(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    check_batch_matches_transformers(llm, hf_model, _prompts(), NEW)


def test_the_paged_keys_equal_transformers_cache(
    checkpoint: Path, hf_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each compressing layer's keys (and the indexer's), read back through the request's block
    table, equal transformers' `compressed_kv` after the prompt and after decoding."""
    tables: dict[int, list[int]] = {}
    store = CompressedKeys.store

    def recording(self: CompressedKeys, keys: torch.Tensor, table: list[int], first: int) -> None:
        tables[id(self)] = list(table)
        store(self, keys, table, first)

    monkeypatch.setattr(CompressedKeys, "store", recording)
    prompt = _prompts()[3]
    for new in (1, 9):  # after the prompt (its first token sampled), and after decoding
        llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=7, seed=0)
        tokens = list(llm.generate([prompt], _greedy(new))[0].outputs[0].token_ids)
        with torch.inference_mode():
            cache = hf_model(torch.tensor([prompt + tokens[:-1]]), use_cache=True).past_key_values
        layers = llm.engine.runner.model.model.layers
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            for module, name in ((attn.keys, "compressor"), (attn.index_keys, "indexer")):
                if module is None:
                    continue
                want = cache.layers[index].compressed_kv[name][0]
                got = module.read(tables[id(module)], want.shape[0], want.dtype)
                assert want.shape[0] == (len(prompt) + new - 1) // attn.rate
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefix_hits_restore_the_state_and_reuse_the_keys(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    """Where prompts branch (the third prompt restores what the second saved) and a
    conversation's next turn: the window and carries from the snapshot, the compressed keys
    from the shared blocks; both hits give transformers' tokens."""
    check_snapshot_hits(checkpoint, hf_model)


def test_preempted_requests_resume_to_the_same_tokens(checkpoint: Path) -> None:
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


def test_a_block_size_that_splits_a_window_is_refused(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match=r"block_size 6 is not a multiple of .* rate 4"):
        LLM(str(checkpoint), block_size=6, kv_capacity=96)


def test_cache_and_state_specs_by_layer_kind(checkpoint: Path) -> None:
    """No key per token anywhere: the compressing layers page a key per window (and the
    sparse ones an indexer key), every layer keeps its window and carries as a state; the
    same on every rank."""
    config = ModelConfig.from_checkpoint(checkpoint)
    for tp_size in (1, 2):
        parallel = ParallelContext(tp_rank=tp_size - 1, tp_size=tp_size)
        assert DeepseekV4ForCausalLM.cache_specs(config, parallel) == [
            CompressedKeySpec(32, 2, 16),  # the trailing rope dims
            CompressedKeySpec(16, 2, index=True),
            CompressedKeySpec(32, 4, 16),
            CompressedKeySpec(32, 2, 16),
            CompressedKeySpec(16, 2, index=True),
        ]
        sparse = (CarrySpec(2, 64, 32), CarrySpec(2, 32, 16))
        assert DeepseekV4ForCausalLM.state_specs(config, parallel) == [
            V4StateSpec(32, 5, (), 16),
            V4StateSpec(32, 5, sparse, 16),
            V4StateSpec(32, 5, (CarrySpec(4, 32),), 16),
            V4StateSpec(32, 5, sparse, 16),
        ]
    assert CompressedKeySpec(512, 4).bytes_per_token(torch.bfloat16) == 256
    assert CompressedKeySpec(512, 128).bytes_per_token(torch.bfloat16) == 8
    fp8 = CompressedKeySpec(512, 4, 64, kv_dtype="fp8_e4m3")  # 448 codes, 64 rope dims kept
    assert fp8.bytes_per_token(torch.bfloat16) == (464 + 128) // 4
    # The window's keys in a state slot: 448 codes in 14 Q8_0 blocks (476 bytes, 480 aligned),
    # the 64 rope dims kept at the state's float32 (256 bytes); 2048 bytes a key at auto.
    window = V4StateSpec(512, 127, (), 64, "int8")
    assert window.window_numel * 4 == 127 * (480 + 256)
    assert V4StateSpec(512, 127, (), 64).window_numel * 4 == 127 * 2048
    index = CompressedKeySpec(128, 4, index=True, kv_dtype="int4")  # indexer keys: 8-bit
    assert index.row_format == CompressedKeySpec(128, 4, index=True, kv_dtype="int8").row_format


def _release_spelling(source: Path, out: Path) -> Path:
    """The checkpoint as DeepSeek's release names it: no `model.` prefix, `embed`, `head`,
    `hc_head_*`, per-layer `compress_ratios`, a flat YaRN `rope_scaling`, an MTP layer."""
    shutil.copytree(source, out)
    config = json.loads((source / "config.json").read_text())
    yarn = config["rope_parameters"]["compress"]
    for key in ("layer_types", "rope_parameters", "compress_rates", "partial_rotary_factor"):
        config.pop(key)
    config.update(
        compress_ratios=[0, 4, 128, 4],
        compress_rate_csa=2,
        compress_rate_hca=4,
        rope_scaling={k: v for k, v in yarn.items() if k not in ("rope_theta", "attention_factor")},
        partial_rotary_factor=None,
    )
    (out / "config.json").write_text(json.dumps(config))
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        renamed = {}
        for name, tensor in tensors.items():
            name = top.get(name, name).removeprefix("model.")
            renamed[name.replace("hc_head.hc_", "hc_head_")] = tensor
        renamed["mtp.0.attn_norm.weight"] = torch.ones(4)  # skipped
        save_file(renamed, str(file), metadata={"format": "pt"})
    return out


def test_the_release_spelling_serves_the_same_tokens(checkpoint: Path, tmp_path: Path) -> None:
    release = _release_spelling(checkpoint, tmp_path / "release")
    ours, theirs = ModelConfig.from_checkpoint(checkpoint), ModelConfig.from_checkpoint(release)
    assert V4Dims.of(theirs) == V4Dims.of(ours)
    assert v4_ropes(theirs.raw) == v4_ropes(ours.raw)
    main, compress = v4_ropes(ours.raw)
    assert (main.rope_type, main.theta) == ("default", 10000.0)
    assert (compress.rope_type, compress.theta, compress.attention_factor) == ("yarn", 160000.0, 1)
    prompts = _prompts()
    expected = LLM(str(checkpoint), block_size=4, seed=0).generate(prompts, _greedy())
    got = LLM(str(release), block_size=4, seed=0).generate(prompts, _greedy())
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
