"""The checkpoint's recommended sampling settings (generation_config.json) fill in what a request
leaves out, as vLLM does; explicit request values always win, and `generation_config: none`
restores the API defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from dgpp.engine.sampling.sampling_defaults import SamplingDefaults, load_sampling_defaults
from dgpp.engine.server.openai.protocol import CompletionRequest
from dgpp.engine.server.pipeline.api_sampling import ApiSampling, sampling_params
from tests.conftest import build_tiny_checkpoint
from tests.engine.server.harness import running_server

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2}


def test_the_sampling_keys_are_read_and_bad_ones_ignored(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    defaults = load_sampling_defaults(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert defaults.describe() == "temperature=0.6, top_p=0.95, top_k=20"
    bad = {"temperature": "hot", "top_p": 0, "top_k": 2.5, "min_p": True, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps(bad))
    assert load_sampling_defaults(tmp_path) == SamplingDefaults(repetition_penalty=1.1)
    (tmp_path / "generation_config.json").write_text("{not json")
    assert load_sampling_defaults(tmp_path) == SamplingDefaults()
    assert load_sampling_defaults(tmp_path / "absent") == SamplingDefaults()


def test_request_values_win_over_the_checkpoint_and_api_defaults_fill_the_rest() -> None:
    model = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05)
    omitted = sampling_params(
        ApiSampling.of(CompletionRequest(model="m", prompt="x")), 8, None, defaults=model
    )
    assert (omitted.temperature, omitted.top_p, omitted.top_k) == (0.6, 0.95, 20)
    assert (omitted.min_p, omitted.repetition_penalty) == (0.0, 1.05)
    explicit = CompletionRequest(
        model="m", prompt="x", temperature=1.0, top_k=0, repetition_penalty=1.0
    )
    chosen = sampling_params(ApiSampling.of(explicit), 8, None, defaults=model)
    assert (chosen.temperature, chosen.top_p, chosen.top_k) == (1.0, 0.95, 0)
    assert chosen.repetition_penalty == 1.0
    plain = sampling_params(ApiSampling.of(CompletionRequest(model="m", prompt="x")), 8, None)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A checkpoint whose generation_config.json asks for temperature 0 (greedy)."""
    root = tmp_path_factory.mktemp("greedy")
    checkpoint = build_tiny_checkpoint(root / "m", tokenizer_dir, "LlamaForCausalLM")
    config = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    return checkpoint


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_a_request_without_temperature_follows_the_checkpoint(
    greedy_by_default: Path, tmp_path: Path, mode: str
) -> None:
    checkpoint = tmp_path / "m"
    shutil.copytree(greedy_by_default, checkpoint)
    engine = {"kv_capacity": 512, "block_size": 16, "seed": 1}
    with running_server(checkpoint, ("m",), engine, {"generation_config": mode}) as server:
        assert server.state.sampling_defaults.temperature == (0.0 if mode == "auto" else None)

        def complete(**fields: object) -> list[str]:
            body = {"model": "m", "prompt": "1 2 3", "max_tokens": 12, "n": 4, **fields}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return [choice["text"] for choice in response.json()["choices"]]

        greedy = complete(temperature=0)
        assert len(set(greedy)) == 1
        if mode == "auto":
            assert complete() == greedy  # greedy by the checkpoint's word
        else:
            assert len(set(complete())) > 1  # temperature 1.0: four draws of a random model


def test_the_offline_api_uses_the_checkpoint_defaults_when_given_no_params(
    greedy_by_default: Path,
) -> None:
    from dgpp.engine import LLM, SamplingParams

    llm = LLM(str(greedy_by_default), kv_capacity=256, block_size=16)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.0, 1.0, 0)
    prompts = [[5, 6, 7]] * 3
    texts = {o.outputs[0].text for o in llm.generate(prompts)}
    greedy = llm.generate(prompts[:1], SamplingParams(temperature=0.0))[0].outputs[0].text
    assert texts == {greedy}
