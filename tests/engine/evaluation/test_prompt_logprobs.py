"""Prompt logprobs (`SamplingParams.prompt_logprobs`, issue 44): every prompt token's
log-probability under the positions before it (the first has none), its rank and the best
alternatives, computed in the engine's prefill chunks, equal to transformers' (float32); a
cached prefix is recomputed for them, a preempted request's come out the same, and the tokens
generated after them are unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.errors import InvalidRequestError
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import random_prompts

TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("prompt-logprobs")
    return build_tiny_checkpoint(out, tokenizer_dir, "Qwen3ForCausalLM")


def _params(**extra: object) -> SamplingParams:
    settings: dict[str, object] = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    return SamplingParams(**{**settings, **extra})  # type: ignore[arg-type]


def _reference(hf_model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)  # [P, V]: row p predicts token p + 1


def test_prompt_logprobs_equal_transformers(checkpoint: Path) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    prompts = random_prompts(11, (2, 9, 30))
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=7, kv_capacity=1024)
    plain = llm.generate(prompts, _params())
    scored = llm.generate(prompts, _params(prompt_logprobs=TOP))
    for prompt, output, before in zip(prompts, scored, plain, strict=True):
        assert output.outputs[0].token_ids == before.outputs[0].token_ids
        got = output.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        want = _reference(hf_model, prompt)
        for position in range(1, len(prompt)):
            entry, row = got[position], want[position - 1]
            assert entry is not None and entry.token_id == prompt[position]
            assert abs(entry.logprob - row[prompt[position]].item()) < 1e-4
            chosen = row[prompt[position]]  # the rank up to tokens within rounding of it
            assert (
                int((row > chosen + 1e-4).sum())
                < entry.rank
                <= int((row > chosen - 1e-4).sum()) + 1
            )
            best = row.topk(TOP)
            assert [token for token, _ in entry.top] == best.indices.tolist()
            for (_, value), expected in zip(entry.top, best.values.tolist(), strict=True):
                assert abs(value - expected) < 1e-4
    assert plain[0].prompt_logprobs is None


def test_a_cached_prefix_is_recomputed_and_preemption_changes_nothing(checkpoint: Path) -> None:
    prompt = list(range(300, 340))
    roomy = LLM(str(checkpoint), block_size=4, prefill_chunk_tokens=16, prefix_min_tokens=4)
    first = roomy.generate([prompt], _params(prompt_logprobs=1))[0]
    again = roomy.generate([prompt], _params(prompt_logprobs=1))[0]  # its blocks are cached
    assert again.num_cached_tokens == 0 and again.prompt_logprobs == first.prompt_logprobs
    tight = LLM(str(checkpoint), block_size=4, kv_capacity=64, prefill_chunk_tokens=8)
    batch = [prompt, list(range(700, 730))]
    outputs = tight.generate(batch, _params(prompt_logprobs=1, max_tokens=12))
    assert tight.engine.counters.num_preemptions > 0
    assert outputs[0].prompt_logprobs == first.prompt_logprobs


@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_bad_values_are_refused_by_name(value: object) -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_completions_score_an_echoed_prompt(checkpoint: Path, tokenizer_dir: Path) -> None:
    """lm-evaluation-harness's request (`echo`, `logprobs`, `max_tokens: 0`) and vLLM's
    `prompt_logprobs` through the server: the prompt's tokens with transformers' logprobs,
    the first null, nothing generated; streaming them is refused by name."""
    import httpx

    from tests.engine.server.harness import running_server

    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    text = "The quick brown fox jumps over the lazy dog"
    with running_server(checkpoint, ("m",), {"block_size": 4, "kv_capacity": 1024}) as server:
        ids = server.state.tokenizer(text).input_ids
        body = {"model": "m", "prompt": text, "echo": True, "logprobs": 2, "max_tokens": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        vllm = {**body, "echo": False, "max_tokens": 1, "prompt_logprobs": 1}
        other = httpx.post(f"{server.url}/v1/completions", json=vllm, timeout=60)
        streamed = httpx.post(
            f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
        )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] == text and reply.json()["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"][1]) == 2
    want = _reference(hf_model, ids)
    for position in range(1, len(ids)):
        expected = want[position - 1, ids[position]].item()
        assert abs(logprobs["token_logprobs"][position] - expected) < 1e-4
    assert other.status_code == 200, other.text
    listed = other.json()["choices"][0]["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(ids)
    entry = listed[1][str(ids[1])]
    assert abs(entry["logprob"] - want[0, ids[1]].item()) < 1e-4 and entry["rank"] >= 1
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def test_world_of_two_scores_as_transformers_and_bounds_the_prompt(
    checkpoint: Path, tmp_path: Path
) -> None:
    """`dgpp serve --world 2` (two ranks over gloo, each half the heads and of the vocabulary's
    logits): the prompt's logprobs equal transformers'; a prompt longer than
    `engine.max_scored_prompt_tokens` is refused by name and the server still serves."""
    import httpx

    from tests.appliance.world_harness import start, wait_healthy
    from tests.engine.server.harness import free_port

    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    port = free_port()
    args = ["serve", "--model", str(checkpoint), "--world", "2", "--port", str(port)]
    args += ["--rendezvous-port", str(free_port()), "--served-model-name", "m"]
    args += ["--kv-capacity", "1024", "--prefill-chunk-tokens", "7", "--block-size", "4"]
    args += ["--max-scored-prompt-tokens", "30"]
    process = start(args, tmp_path / "serve.log", {"DGPP_CONSUMER_DEADLINE_S": "10"})
    url = f"http://127.0.0.1:{port}"
    prompt = random_prompts(5, (30,))[0]
    body = {"model": "m", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
    try:
        assert wait_healthy(url, process)["world_size"] == 2
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        longer = {**body, "prompt": [*prompt, 7]}
        refused = httpx.post(f"{url}/v1/completions", json=longer, timeout=60)
        plain = httpx.post(f"{url}/v1/completions", json={**longer, "echo": False}, timeout=60)
    finally:
        assert process.stop() == 0, process.text()[-3000:]
    assert reply.status_code == 200, reply.text
    got = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
    want = _reference(hf_model, prompt)
    assert got[0] is None and len(got) == len(prompt)
    for position in range(1, len(prompt)):
        assert abs(got[position] - want[position - 1, prompt[position]].item()) < 1e-4
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    assert "max_scored_prompt_tokens" in refused.json()["error"]["message"]
    assert plain.status_code == 200, plain.text  # scoring nothing: no bound
