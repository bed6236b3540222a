"""Qwen3.5 (dense) and Qwen3.5-MoE against transformers' PyTorch fallback on tiny random configs:
greedy tokens of a mixed batch with prefill chunks crossing blocks, the logits, a prefix hit that
restores a recurrent-state snapshot, and world 2 equal to world 1; the vision-language
checkpoints serving text prompts (nested text config, `model.language_model.*` names, the MTP
layers skipped, stacked experts, tied embeddings; their images: tests/engine/vision)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.models.qwen3_next import Qwen3NextForCausalLM
from tests.conftest import build_tiny_checkpoint, tiny_model
from tests.engine.parity import hf_greedy, max_logit_difference

NEW_TOKENS = 12
FAMILIES = ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]


@pytest.fixture(scope="module", params=FAMILIES, ids=["dense", "moe"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    return build_tiny_checkpoint(out, tokenizer_dir, request.param)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in (1, 5, 13, 40)]


def _greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _check_parity(llm: LLM, hf_model: torch.nn.Module) -> None:
    """One batch of mixed prompts (decodes beside prefill chunks): transformers' greedy tokens,
    and its logits within 1e-3 at every sampled position."""
    prompts = _prompts()
    outputs = llm.generate(prompts, _greedy())
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == expected, f"prompt of {len(prompt)} tokens"
    assert len({token for o in outputs for token in o.outputs[0].token_ids}) > 20
    worst = max(
        max_logit_difference(llm, hf_model, prompt, hf_greedy(hf_model, prompt, 6))
        for prompt in prompts[1:4]
    )
    assert worst < 1e-3, worst


def test_greedy_tokens_and_logits_match_transformers(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    _check_parity(llm, hf_model)
    manager = llm.engine.block_manager
    assert manager.num_used_blocks == 0
    assert manager.states is not None
    assert manager.states.slots.num_free == llm.engine.config.max_concurrency


def test_prefix_hit_restores_a_snapshot_and_continues(
    checkpoint: Path, hf_model: torch.nn.Module
) -> None:
    """A second turn extends the first turn's prompt and reply: it restores the snapshot at the
    first prompt's last full block (24 tokens) and computes the rest."""
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=7, prefix_min_tokens=8)
    engine = llm.engine
    system = list(range(500, 521))
    first = system + [7, 8, 9, 10, 11, 12]  # 27 tokens

    def run(prompt: list[int]) -> list[int]:
        request = engine.add_request(prompt, _greedy(8), cache_hints=(len(system),))
        while engine.has_unfinished():
            engine.step()
        tokens = request.output_token_ids
        assert tokens == hf_greedy(hf_model, prompt, 8), f"prompt of {len(prompt)} tokens"
        return tokens

    reply = run(first)
    snapshots = engine.block_manager.states.snapshots
    assert snapshots.stats().held == 2  # after 20 (the hint) and 24 (the last full block)
    run(first + reply + [40, 41, 42])
    stats = snapshots.stats()
    assert stats.hits == 1 and stats.hits_by_depth == {6: 1}
    assert engine.counters.prefix_cache.hit_tokens == 24
    assert engine.block_manager.states.slots.num_free == engine.config.max_concurrency


def test_world_of_two_equals_world_of_one(checkpoint: Path) -> None:
    """Split projections across ranks: each rank's q, k and v rows of `in_proj_qkv`, its value
    heads' rows of `in_proj_z`, `in_proj_b` and `in_proj_a`."""
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    _check_world_of_two(checkpoint, KNOBS)


VISION_LANGUAGE = [
    ("Qwen3_5ForConditionalGeneration", {"tie_word_embeddings": True}),
    ("Qwen3_5MoeForConditionalGeneration", {}),
]


@pytest.fixture(scope="module", params=VISION_LANGUAGE, ids=["dense-tied", "moe-stacked"])
def vision_language(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[Path, torch.nn.Module]:
    """A tiny vision-language checkpoint as released: its weights under
    `model.language_model.*` beside the vision tower's and an MTP layer's; the MoE one with its
    experts stacked ([E, 2I, H] gate/up, [E, H, I] down). With the transformers model."""
    architecture, overrides = request.param
    out = tmp_path_factory.mktemp(architecture)
    model = tiny_model(architecture, **overrides)
    model.save_pretrained(str(out), safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        (out / item.name).write_bytes(item.read_bytes())
    weights = out / "model.safetensors"
    tensors = load_file(str(weights))
    assert any(name.startswith("model.visual.") for name in tensors)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(4, 4)
    if "Moe" in architecture:
        tensors = _stack_experts(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return out, model


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (as `save_pretrained` writes them) stacked as the released checkpoints
    store them."""
    stacks: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    kept = {}
    for name, tensor in tensors.items():
        stem, found, rest = name.partition(".mlp.experts.")
        if not found or name.startswith("mtp."):
            kept[name] = tensor
            continue
        expert, projection, _ = rest.split(".")
        stacks.setdefault(stem, {}).setdefault(int(expert), {})[projection] = tensor
    for stem, experts in stacks.items():
        order = [experts[index] for index in sorted(experts)]
        gate_up = [torch.cat((e["gate_proj"], e["up_proj"])) for e in order]
        kept[f"{stem}.mlp.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
        kept[f"{stem}.mlp.experts.down_proj"] = torch.stack([e["down_proj"] for e in order])
    return kept


def test_vision_language_checkpoints_serve_text_prompts(
    vision_language: tuple[Path, torch.nn.Module],
) -> None:
    checkpoint, hf_model = vision_language
    config = ModelConfig.from_checkpoint(checkpoint)
    raw = json.loads((checkpoint / "config.json").read_text())
    assert config.num_layers == raw["text_config"]["num_hidden_layers"] == 4
    assert config.tie_word_embeddings == raw["tie_word_embeddings"]
    assert config.rotary_dim == 8
    names = load_file(str(checkpoint / "model.safetensors")).keys()
    assert ("lm_head.weight" in names) != config.tie_word_embeddings
    if "Moe" in config.architecture:
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=11, kv_capacity=2048, seed=0)
    _check_parity(llm, hf_model)


def test_configs_and_names() -> None:
    """Qwen3.5-MoE has no dense width (its widest expert's stands in); both families skip the
    MTP layers' weights; Qwen3.5 renames the language model's and keeps the vision tower's."""
    moe = ModelConfig.from_dict(tiny_model("Qwen3_5MoeForCausalLM").config.to_dict())
    assert moe.intermediate_size == 32
    assert Qwen3NextForCausalLM.checkpoint_name("mtp.fc.weight") is None
    assert Qwen3NextForCausalLM.checkpoint_name("model.norm.weight") == "model.norm.weight"
    from dgpp.engine.models.qwen3_5 import qwen3_5_checkpoint_name

    name = "model.visual.blocks.0.attn.qkv.weight"
    assert qwen3_5_checkpoint_name(name) == name  # the vision tower loads as it is
    assert qwen3_5_checkpoint_name("mtp.layers.0.input_layernorm.weight") is None
    assert qwen3_5_checkpoint_name("model.language_model.norm.weight") == "model.norm.weight"
    assert qwen3_5_checkpoint_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("vision_language", VISION_LANGUAGE[1:], indirect=True, ids=["moe-stacked"])
def test_stacked_experts_split_across_ranks(vision_language: tuple[Path, torch.nn.Module]) -> None:
    """World 2 on the released layout: renamed names, skipped towers, each rank's slice of
    every stacked expert."""
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    _check_world_of_two(vision_language[0], KNOBS)
