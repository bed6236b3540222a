"""Speculative decoding behind the HTTP API: a step may yield several tokens per request, and
streams, logprobs and usage must still describe every token, with the same text as without."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.server.conftest import DEFAULT_ENGINE, MODEL
from tests.engine.server.harness import RunningServer, running_server

FUNCTION = """def area(width: float, height: float) -> float:
    if width < 0 or height < 0:
        raise ValueError("negative size")
    return width * height
"""
COPY = [{"role": "user", "content": "Repeat this code exactly:\n" + FUNCTION}]


@pytest.fixture(scope="module")
def spec_server(default_checkpoint: Path) -> Iterator[RunningServer]:
    engine = {**DEFAULT_ENGINE, "speculative": "ngram", "spec_depth": 4}
    with running_server(default_checkpoint, (MODEL,), engine) as running:
        yield running


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def test_text_equals_the_plain_server_and_streams_every_token(
    spec_server: RunningServer, server: RunningServer
) -> None:
    fast, plain = _client(spec_server), _client(server)
    kwargs = {"model": MODEL, "messages": COPY, "max_tokens": 48, "temperature": 0}
    expected = plain.chat.completions.create(**kwargs)
    whole = fast.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == expected.choices[0].message.content
    assert whole.usage.completion_tokens == expected.usage.completion_tokens

    stream = fast.chat.completions.create(
        **kwargs, stream=True, logprobs=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == expected.usage.completion_tokens  # one logprob per token, none lost
    assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens
    # Several tokens arrived in one chunk at least once: the drafts were accepted.
    per_chunk = [
        len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs
    ]
    assert max(per_chunk) > 1


def test_metrics_report_accepted_drafts(spec_server: RunningServer) -> None:
    with _client(spec_server) as client:
        client.completions.create(
            model=MODEL,
            prompt="x = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3",
            max_tokens=24,
            temperature=0,
        )
    body = httpx.get(f"{spec_server.url}/v1/metrics", timeout=10).json()["spec_decode"]
    assert body["method"] == "ngram" and body["depth"] == 4
    assert 0 < body["accepted"] <= body["drafted"]
    assert body["acceptance_rate"] == pytest.approx(body["accepted"] / body["drafted"])
    assert len(body["per_position"]) <= 4
    prometheus = httpx.get(f"{spec_server.url}/metrics", timeout=10).text
    sample = f'dgpp:spec_decode_num_accepted_tokens_total{{model_name="{MODEL}"}}'
    assert f"{sample} {float(body['accepted'])}" in prometheus


def test_anthropic_stream_equals_the_plain_server(
    spec_server: RunningServer, server: RunningServer
) -> None:
    import anthropic

    kwargs = {
        "model": MODEL,
        "max_tokens": 40,
        "messages": COPY,
        "stop_sequences": ["height < 0"],
        "extra_body": {"temperature": 0},
    }
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as plain:
        expected = plain.messages.create(**kwargs)
    fast = anthropic.Anthropic(base_url=spec_server.url, api_key="x", max_retries=0)
    with fast, fast.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert expected.stop_reason == "stop_sequence"  # the copy reaches it
    assert streamed == expected.content[0].text
    assert (final.stop_reason, final.stop_sequence) == (
        expected.stop_reason,
        expected.stop_sequence,
    )
    assert final.usage.output_tokens == expected.usage.output_tokens
