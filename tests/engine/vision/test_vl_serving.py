"""Images through the engine on tiny random vision-language checkpoints of each family (Qwen3-VL
with DeepStack, Qwen3-VL-MoE stored as released, Qwen3.5 and Qwen3.5-MoE hybrids), against
transformers' greedy tokens: two images of different grids among text in prefill chunks that
would split them, an image in a later turn over a prefix-cache hit, a repeated image from the
encoder cache, a same-sized different image that must not hit the first one's blocks, and world
2 equal to world 1; bad image inputs are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.scheduling.request import PromptIds
from dgpp.engine.vision.spans import PromptImage
from tests.conftest import tiny_model
from tests.engine.vision.vl_helpers import IMAGE, hf_vl_greedy, pixels, vl_prompt

FAMILIES = [
    ("Qwen3VLForConditionalGeneration", {}),
    ("Qwen3VLMoeForConditionalGeneration", {"moe_intermediate_size": 16}),
    ("Qwen3_5ForConditionalGeneration", {}),
    ("Qwen3_5MoeForConditionalGeneration", {}),
]
NEW = 8


def _greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(
    scope="module", params=FAMILIES, ids=["qwen3-vl", "qwen3-vl-moe", "qwen3.5", "qwen3.5-moe"]
)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[Path, torch.nn.Module]:
    architecture, overrides = request.param
    out = tmp_path_factory.mktemp(architecture)
    model = tiny_model(architecture, **overrides)
    model.save_pretrained(str(out), safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        (out / item.name).write_bytes(item.read_bytes())
    if architecture == "Qwen3VLMoeForConditionalGeneration":
        _as_released(out / "model.safetensors")
    return out, model


def _as_released(weights: Path) -> None:
    """Qwen3-VL-MoE's released layout: stacked experts transposed (gate_up [E, H, 2I], down
    [E, I, H]), as transformers' own conversion expects them."""
    tensors = load_file(str(weights))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(weights), metadata={"format": "pt"})


def _llm(checkpoint: Path, **knobs: object) -> LLM:
    settings = dict(block_size=4, prefill_chunk_tokens=5, kv_capacity=2048, seed=0)
    return LLM(str(checkpoint), **{**settings, **knobs})


def test_images_among_text_match_transformers(family: tuple[Path, torch.nn.Module]) -> None:
    """One batch: two images of different grids (6 and 8 tokens, chunks of 5 would split both),
    an image closing a prompt, and a text-only prompt beside them."""
    checkpoint, hf_model = family
    prompts = [
        vl_prompt([[5, 6, 7], ((1, 4, 6), 1), [11, 12, 13, 14], ((1, 8, 4), 2), [15, 16]]),
        vl_prompt([[21, 22], ((1, 4, 4), 3)]),
        PromptIds([31, 32, 33, 34, 35, 36, 37]),
    ]
    llm = _llm(checkpoint)
    outputs = llm.generate(prompts, _greedy())
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_vl_greedy(hf_model, prompt, NEW)
    vision = llm.engine.runner.vision
    assert vision is not None and vision.images_encoded == 3
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_later_turn_hits_the_caches(family: tuple[Path, torch.nn.Module]) -> None:
    """Turn 2 extends turn 1 (an image) with its reply and another image: its prefix comes
    from the prefix cache, and only the new image is encoded. Without the prefix cache the
    first image comes from the encoder cache instead."""
    checkpoint, hf_model = family
    llm = _llm(checkpoint, prefix_min_tokens=8)
    engine, vision = llm.engine, llm.engine.runner.vision
    assert vision is not None
    first = vl_prompt([[5, 6, 7, 8, 9], ((1, 4, 6), 1), [11, 12, 13, 14, 15, 16, 17]])
    reply = list(llm.generate([first], _greedy())[0].outputs[0].token_ids)
    assert reply == hf_vl_greedy(hf_model, first, NEW)
    second = vl_prompt(
        [
            [5, 6, 7, 8, 9],
            ((1, 4, 6), 1),
            [11, 12, 13, 14, 15, 16, 17, *reply, 40, 41],
            ((1, 4, 4), 2),
        ]
    )
    assert list(second[: len(first) + NEW]) == [*first, *reply]
    hits = engine.counters.prefix_cache.hit_tokens
    assert list(llm.generate([second], _greedy())[0].outputs[0].token_ids) == hf_vl_greedy(
        hf_model, second, NEW
    )
    assert engine.counters.prefix_cache.hit_tokens - hits >= 16
    assert vision.images_encoded == 2
    engine.add_request(second, _greedy(), use_prefix_cache=False)
    while engine.has_unfinished():
        engine.step()
    assert vision.images_encoded == 2 and vision.cache.hits >= 2


def test_a_different_image_of_the_same_size_does_not_hit(
    family: tuple[Path, torch.nn.Module],
) -> None:
    """Two prompts alike but for their image's pixels (the same placeholder tokens): the
    second may reuse the blocks before its image, never one holding image tokens."""
    checkpoint, hf_model = family
    llm = _llm(checkpoint, prefix_min_tokens=8)
    text = list(range(100, 112))
    one, other = (
        vl_prompt([text, ((1, 4, 6), seed), [7, 8, 9, 10, 11, 12, 13, 14]]) for seed in (1, 2)
    )
    assert list(one) == list(other)
    # hybrids keep a recurrent-state snapshot where the text before the image ends
    one, other = (PromptIds(p, cache_hints=(12,), images=p.images) for p in (one, other))
    llm.generate([one], _greedy())
    output = llm.generate([other], _greedy())[0]
    assert list(output.outputs[0].token_ids) == hf_vl_greedy(hf_model, other, NEW)
    assert llm.engine.counters.prefix_cache.hit_tokens == 12  # the text before the image


@pytest.mark.parametrize("family", FAMILIES[:1], indirect=True, ids=["qwen3-vl"])
def test_world_of_two_equals_world_of_one(family: tuple[Path, torch.nn.Module]) -> None:
    """The encoder replicated on both ranks: rank 0 sends each new image's pixels once."""
    from tests.engine.distributed.test_tensor_parallel import KNOBS, _check_world_of_two

    prompts = [
        vl_prompt([[5, 6, 7], ((1, 4, 6), 1), [11, 12, 13, 14], ((1, 8, 4), 2), [15, 16]]),
        vl_prompt([[21, 22], ((1, 4, 6), 1), [23]]),
        [9, 4, 9, 4, 9, 4, 9],
    ]
    _check_world_of_two(family[0], {**KNOBS, "prefill_chunk_tokens": 5}, waves=(prompts,))


@pytest.mark.parametrize("family", FAMILIES[:1], indirect=True, ids=["qwen3-vl"])
def test_bad_images_are_refused(family: tuple[Path, torch.nn.Module]) -> None:
    llm = _llm(family[0])
    good = vl_prompt([[5, 6], ((1, 4, 6), 1), [7]])
    image = good.images[0]
    cases = {
        "not a run of image tokens": PromptIds([*good[:3], 1, *good[4:]], images=good.images),
        "image tokens": PromptIds([*good, IMAGE], images=good.images),
        "pixel_values of shape": PromptIds(
            good, images=[PromptImage(image.span, pixels((1, 4, 4), 1))]
        ),
    }
    for message, prompt in cases.items():
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate([prompt], _greedy())
    assert not llm.engine.has_unfinished()


def test_a_text_only_model_refuses_images(tmp_path: Path, tokenizer_dir: Path) -> None:
    from tests.conftest import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "Qwen3ForCausalLM")
    llm = LLM(str(checkpoint), kv_capacity=256)
    with pytest.raises(InvalidRequestError, match="does not take images"):
        llm.generate([vl_prompt([[5, 6], ((1, 4, 6), 1), [7]])], _greedy())


@pytest.mark.parametrize("family", FAMILIES[:1], indirect=True, ids=["qwen3-vl"])
def test_layer_slices_and_speculation_keep_the_tokens(family: tuple[Path, torch.nn.Module]) -> None:
    """A long prompt's chunks computed a layer a step (the image merged at the first layer,
    DeepStack added at its own), and n-gram verify rows after an image (shifted positions)."""
    from tests.engine.scheduling.test_layer_slices import _sliced

    checkpoint, hf_model = family
    prompt = vl_prompt([list(range(200, 230)), ((1, 8, 4), 2), [7, 8, 9] * 10])
    want = hf_vl_greedy(hf_model, prompt, NEW)
    sliced = _llm(checkpoint, short_prompt_tokens=8, prefill_chunk_tokens=16)
    _sliced(sliced, per_step=1)
    assert list(sliced.generate([prompt], _greedy())[0].outputs[0].token_ids) == want
    assert sliced.engine.counters.num_layer_slices > 0
    spec = _llm(checkpoint, speculative="ngram", spec_ngram_min=1)
    assert list(spec.generate([prompt], _greedy())[0].outputs[0].token_ids) == want
    assert spec.engine.counters.spec_decode.draft_tokens > 0
