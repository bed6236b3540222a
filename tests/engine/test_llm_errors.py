"""Bad input to the offline API raises typed errors with clear messages and leaves no state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.errors import (
    ConfigError,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)
from tests.conftest import build_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer_dir, "Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), kv_capacity=256, block_size=8, max_model_len=64)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="empty") as info:
        llm.generate([""])
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]])


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_non_positive_max_tokens(max_tokens: int) -> None:
    with pytest.raises(InvalidRequestError, match="max_tokens must be at least 1") as info:
        SamplingParams(max_tokens=max_tokens)
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("logprobs", 99),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 2.5),
        ("stop", [""]),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_out_of_range_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_prompt_over_max_model_len(llm: LLM) -> None:
    with pytest.raises(ContextLengthExceededError, match="64 tokens") as info:
        llm.generate([list(range(10, 80))])
    assert info.value.code == "context_length_exceeded"


def test_prompt_plus_max_tokens_over_the_context(llm: LLM) -> None:
    with pytest.raises(ContextLengthExceededError, match="max_tokens"):
        llm.generate([list(range(10, 50))], SamplingParams(max_tokens=30))


def test_bad_token_ids(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[1, 2, 10**7]])
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[1, -2]])


def test_a_bad_prompt_in_a_batch_leaves_nothing_queued(llm: LLM) -> None:
    with pytest.raises(ContextLengthExceededError):
        llm.generate([[5, 6, 7], list(range(10, 90))])
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].finished


def test_sampling_params_count_must_match(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])


def test_unknown_architecture(tmp_path: Path, checkpoint: Path) -> None:
    target = tmp_path / "weird"
    shutil.copytree(checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match=r"MambaForCausalLM.*supported: .*LlamaForCausalLM"
    ):
        LLM(str(target))


def test_missing_weights(tmp_path: Path, checkpoint: Path) -> None:
    from safetensors.torch import load_file, save_file

    target = tmp_path / "partial"
    shutil.copytree(checkpoint, target)
    weights = load_file(str(target / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"missing 1 weights: model\.layers\.1\.mlp\.down_proj"
    ):
        LLM(str(target))


def test_no_weight_files(tmp_path: Path, checkpoint: Path) -> None:
    target = tmp_path / "empty"
    shutil.copytree(checkpoint, target)
    (target / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        LLM(str(target))


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config.json"):
        LLM(str(tmp_path))


def test_unknown_engine_option(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown engine option.*kv_capacty"):
        LLM(str(checkpoint), kv_capacty=10)


def test_bad_knob_values(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        LLM(str(checkpoint), block_size=0)
    with pytest.raises(ConfigError, match="prefill_precision"):
        LLM(str(checkpoint), prefill_precision="fp8")
    with pytest.raises(ConfigError, match="max_model_len=100000 exceeds"):
        LLM(str(checkpoint), max_model_len=100000)


def test_logit_bias_past_the_vocabulary_is_refused_and_leaves_no_state(llm: LLM) -> None:
    vocab_size = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match=f"in \\[0, {vocab_size}\\)") as info:
        llm.generate(["hi"], SamplingParams(max_tokens=2, logit_bias={vocab_size: 5.0}))
    assert info.value.param == "logit_bias"
    assert not llm.engine.scheduler.requests
    inside = SamplingParams(max_tokens=2, logit_bias={vocab_size - 1: 5.0}, temperature=0)
    assert llm.generate(["hi"], inside)[0].outputs[0].token_ids
