"""GGUF files served as they are: tiny random-weight Llama/Qwen2/Qwen3 models written as GGUF in
each block format give dgpp's greedy tokens equal to transformers' on the same file (transformers
dequantizes with gguf-py; the reference is its float32 model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.errors import ModelLoadError, UnsupportedModelError
from dgpp.engine.llm import checkpoint_directory
from tests.conftest import tiny_model
from tests.engine.parity import hf_greedy
from tests.engine.quant.gguf_build import write_gguf

PROMPTS = [[1, 504, 3458, 314, 253, 2018, 28], list(range(600, 640))]
# K-quants need rows of whole 256-weight super-blocks.
WIDE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture(scope="module", autouse=True)
def _views_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Views (and their shared tokenizer) in this module's own cache directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


# The first 4,096 tokens of SmolLM2's vocabulary (and the merges among them): the prompts'
# ids are below it, and transformers reads a small file's tokenizer fast (three times a load).
VOCAB = 4096


def _tiny(architecture: str, **overrides: object) -> torch.nn.Module:
    return tiny_model(architecture, 0, **{"vocab_size": VOCAB, **overrides})


def _reference(path: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return [hf_greedy(model, prompt, steps) for prompt in prompts]


CASES = [
    ("LlamaForCausalLM", "F32", {}),
    ("LlamaForCausalLM", "F16", {}),
    ("LlamaForCausalLM", "BF16", {}),
    ("LlamaForCausalLM", "Q8_0", {}),
    ("LlamaForCausalLM", "Q4_0", {}),
    ("LlamaForCausalLM", "Q4_1", {}),
    # transformers' GGUF reader leaves Qwen3's head_dim at its default, 128
    ("Qwen3ForCausalLM", "Q5_0", {"head_dim": 128}),
    ("Qwen2ForCausalLM", "Q5_1", {}),
    ("LlamaForCausalLM", "Q4_K", WIDE),
    ("Qwen3ForCausalLM", "Q5_K", {**WIDE, "head_dim": 128}),
    ("Qwen2ForCausalLM", "Q6_K", WIDE),
]


@pytest.mark.parametrize(
    ("architecture", "weight_format", "overrides"), CASES, ids=[f"{a[:5]}-{f}" for a, f, _ in CASES]
)
def test_greedy_tokens_equal_transformers_on_the_same_gguf(
    tmp_path: Path, tokenizer_gguf: Path, architecture: str, weight_format: str, overrides: dict
) -> None:
    model = _tiny(architecture, **overrides)
    path = write_gguf(
        model,
        architecture,
        tmp_path / f"tiny-{weight_format}.gguf",
        weight_format,
        tokenizer_gguf,
        embedding_format="Q8_0" if weight_format.startswith("Q") else weight_format,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(path), kv_capacity=512, block_size=4)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    assert got == _reference(path, PROMPTS, 12)


def test_the_view_carries_the_files_tokenizer_and_chat_template(
    tmp_path: Path, tokenizer_gguf: Path
) -> None:
    view = checkpoint_directory(str(tokenizer_gguf))
    assert (view / "model.gguf").resolve() == tokenizer_gguf.resolve()
    assert checkpoint_directory(str(tokenizer_gguf)) == view  # written once, then reused
    llm = LLM(str(tokenizer_gguf), kv_capacity=256)
    messages = [{"role": "user", "content": "Hi"}]
    ids = llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = llm.engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert 2 in llm.engine.eos_token_ids  # <|im_end|>, the file's EOS


def test_unsupported_architecture_and_tensor_type_are_refused_by_name(
    tmp_path: Path, tokenizer_gguf: Path
) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UnsupportedModelError,
        match="GGUF architecture 'mamba' is not supported; supported: bert, llama, qwen2, qwen3",
    ):
        checkpoint_directory(str(path))

    path = tmp_path / "iq.gguf"
    writer = GGUFWriter(str(path), "llama")
    raw = torch.zeros(4, 66, dtype=torch.uint8).numpy()  # one 256-weight IQ2_XXS block per row
    writer.add_tensor("token_embd.weight", raw, raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError,
        match=r"tensor token_embd\.weight has GGUF type IQ2_XXS, "
        r"which dgpp does not read; supported: F32, F16",
    ):
        checkpoint_directory(str(path))


def test_a_truncated_file_is_refused_with_a_clear_error(
    tmp_path: Path, tokenizer_gguf: Path
) -> None:
    model = _tiny("LlamaForCausalLM")
    path = write_gguf(model, "LlamaForCausalLM", tmp_path / "t.gguf", "Q4_1", tokenizer_gguf)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ModelLoadError, match=r"t\.gguf"):
        LLM(str(path), kv_capacity=256)


def test_a_warm_start_maps_the_packed_weights_from_the_resident_image(
    tmp_path: Path, tokenizer_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import safe_open

    from dgpp.engine.checkpoint import loader

    model = _tiny("LlamaForCausalLM")
    path = write_gguf(model, "LlamaForCausalLM", tmp_path / "w.gguf", "Q4_1", tokenizer_gguf)
    cache = tmp_path / "resident"
    knobs = {"kv_capacity": 512, "block_size": 4, "resident_cache_dir": str(cache)}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cold = [list(o.outputs[0].token_ids) for o in LLM(str(path), **knobs).generate(PROMPTS, params)]
    (image,) = sorted(cache.glob("*.safetensors"))
    with safe_open(str(image), framework="pt") as handle:
        stored = handle.get_slice("model.layers.0.mlp.gate_up_proj.weight")
        assert stored.get_dtype() == "U8"  # the image holds the blocks, not floats
        assert stored.get_shape() == [256, 2 * 20]  # 2 x 128 rows of two Q4_1 blocks each

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF file was read on a warm start")

    monkeypatch.setattr(loader, "load_weights", refuse)
    warm = [list(o.outputs[0].token_ids) for o in LLM(str(path), **knobs).generate(PROMPTS, params)]
    assert warm == cold


def test_a_gguf_served_as_an_embedding_model_equals_transformers_last_hidden_state(
    tmp_path: Path, tokenizer_gguf: Path
) -> None:
    """The GGUF embedding files llama.cpp serves (a Qwen3 decoder, Q8_0): `kind="embed"` reads
    them as they are; each embedding is transformers' last-token final hidden state on the same
    file, normalized."""
    from transformers import AutoModelForCausalLM

    model = _tiny("Qwen3ForCausalLM", head_dim=128)
    path = write_gguf(model, "Qwen3ForCausalLM", tmp_path / "emb.gguf", "Q8_0", tokenizer_gguf,
                      embedding_format="Q8_0")  # fmt: skip
    got = LLM(str(path), kind="embed", kv_capacity=512, block_size=4).embed(PROMPTS)
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for embedding, prompt in zip(got, PROMPTS, strict=True):
        with torch.no_grad():
            hidden = reference.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(hidden, dim=0)
        torch.testing.assert_close(torch.tensor(embedding), want, atol=1e-4, rtol=1e-3)
