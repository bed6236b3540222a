"""The official `openai` SDK against a real dgpp server on the default model."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.engine.server.conftest import ALIAS, MAX_MODEL_LEN, MODEL
from tests.engine.server.harness import RunningServer

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _tokens(http: httpx.Client, text: str) -> list[int]:
    response = http.post("/tokenize", json={"prompt": text})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_chat_non_streaming(sdk: openai.OpenAI, http: httpx.Client, server: RunningServer) -> None:
    reply = sdk.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=32, temperature=0)
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.model == MODEL
    assert len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert choice.logprobs is None
    prompt = http.post("/tokenize", json={"messages": FRANCE}).json()
    assert reply.usage.prompt_tokens == prompt["count"]
    assert 1 <= reply.usage.completion_tokens <= 32
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    server.wait_idle()


def test_chat_stream_text_equals_non_stream_text_at_temperature_zero(sdk: openai.OpenAI) -> None:
    whole = sdk.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=32, temperature=0)
    stream = sdk.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=32, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.id == chunks[0].id for chunk in chunks)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(chunk.usage is None for chunk in chunks)  # no usage unless asked for


def test_stream_include_usage_gives_a_final_usage_chunk(sdk: openai.OpenAI) -> None:
    whole = sdk.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=32, temperature=0)
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=FRANCE,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_stream_usage_counts_every_choice_and_ignore_eos_length(sdk: openai.OpenAI) -> None:
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=FRANCE,
            max_tokens=7,
            n=2,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 14
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices}
    assert finishes == {0: "length", 1: "length"}


def test_completion_string_prompt(sdk: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The capital of France is"
    reply = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert reply.object == "text_completion"
    assert reply.id.startswith("cmpl-")
    assert len(reply.choices) == 1
    assert reply.choices[0].text.strip()
    assert not reply.choices[0].text.startswith(prompt)  # no echo unless asked
    assert reply.usage.prompt_tokens == len(_tokens(http, prompt))
    assert reply.usage.completion_tokens <= 6


def test_completion_default_max_tokens_is_16(sdk: openai.OpenAI) -> None:
    reply = sdk.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"


def test_completion_list_of_prompts_matches_each_prompt_alone(sdk: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    batch = sdk.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [choice.index for choice in batch.choices] == [0, 1]
    for prompt, choice in zip(prompts, batch.choices, strict=True):
        alone = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
        assert choice.text == alone.choices[0].text
    singles = [
        sdk.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).usage
        for p in prompts
    ]
    assert batch.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)
    assert batch.usage.completion_tokens == sum(u.completion_tokens for u in singles)


def test_completion_token_id_prompt_matches_string_prompt(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    prompt = "The capital of France is"
    ids = _tokens(http, prompt)
    by_text = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    by_ids = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    nested = sdk.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in nested.choices] == [by_text.choices[0].text] * 2


def test_completion_echo_prefixes_the_prompt(sdk: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    echoed = sdk.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text


def test_completion_logprobs(sdk: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    reply = sdk.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None
    # echoed: the prompt's tokens first (the first without a logprob), as OpenAI's legacy API
    prompted = len(logprobs.tokens) - 5
    assert prompted > 1 and "".join(logprobs.tokens[:prompted]) == prompt
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(logprobs.text_offset)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value <= 0.0 and math.isfinite(value) for value in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text and logprobs.text_offset[0] == 0
    for offset, token, following in zip(
        logprobs.text_offset, logprobs.tokens, logprobs.text_offset[1:], strict=False
    ):
        assert following == offset + len(token)
    generated = zip(
        logprobs.tokens[prompted:],
        logprobs.token_logprobs[prompted:],
        logprobs.top_logprobs[prompted:],
        strict=True,
    )
    for token, value, top in generated:
        assert 1 <= len(top) <= 3
        assert all(v <= 0.0 for v in top.values())
        # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(value, abs=1e-5)
        assert top[token] == pytest.approx(value, abs=1e-5)


def test_n_choices_with_seed_are_reproducible(sdk: openai.OpenAI) -> None:
    def ask() -> list[str]:
        reply = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a word."}],
            max_tokens=12,
            temperature=1.0,
            n=3,
            seed=1234,
        )
        assert [choice.index for choice in reply.choices] == [0, 1, 2]
        assert all(choice.message.content for choice in reply.choices)
        assert 3 <= reply.usage.completion_tokens <= 36
        return [choice.message.content for choice in reply.choices]

    first, second = ask(), ask()
    assert first == second
    assert len(set(first)) > 1  # each choice samples its own stream


def test_chat_logprobs_and_top_logprobs(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(entry.token for entry in content).startswith(choice.message.content)
    for entry in content:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 4
        values = [top.logprob for top in entry.top_logprobs]
        assert all(value <= 0.0 for value in values)
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_chat_logprobs_without_top_logprobs(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=4, temperature=0, logprobs=True
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(entry.top_logprobs == [] and entry.logprob <= 0.0 for entry in content)


def test_stream_logprobs_match_non_stream(sdk: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=FRANCE, max_tokens=8, temperature=0, logprobs=True)
    whole = sdk.chat.completions.create(**kwargs, top_logprobs=2)
    streamed = [
        entry
        for chunk in sdk.chat.completions.create(**kwargs, top_logprobs=2, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]
    for got, want in zip(streamed, whole.choices[0].logprobs.content, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_models_list_and_retrieve(sdk: openai.OpenAI) -> None:
    models = sdk.models.list()
    assert [model.id for model in models.data] == [MODEL, ALIAS]
    for card in models.data:
        assert card.object == "model"
        assert card.owned_by == "dgpp"
        assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
        assert card.model_extra["root"] == MODEL
    assert sdk.models.retrieve(ALIAS).id == ALIAS
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"


def test_served_model_alias_is_accepted_and_first_name_reported(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model=ALIAS, messages=FRANCE, max_tokens=2, temperature=0)
    assert reply.model == MODEL
    completion = sdk.completions.create(model=ALIAS, prompt="Hi", max_tokens=2, temperature=0)
    assert completion.model == MODEL


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_unknown_model_raises_not_found(sdk: openai.OpenAI, route: str) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        if route == "chat":
            sdk.chat.completions.create(model="gpt-4o", messages=FRANCE, max_tokens=2)
        else:
            sdk.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert caught.value.type == "invalid_request_error"


def test_stop_string_is_cut_from_content(sdk: openai.OpenAI) -> None:
    whole = sdk.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=32, temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text
    stopped = sdk.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=32, temperature=0, stop=["Paris", "zzz"]
    )
    choice = stopped.choices[0]
    assert choice.message.content == text[: text.index("Paris")]
    assert choice.finish_reason == "stop"
    kept = sdk.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        max_tokens=32,
        temperature=0,
        stop="Paris",
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].message.content == text[: text.index("Paris") + len("Paris")]


def test_stop_string_in_stream_matches_non_stream(sdk: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=FRANCE, max_tokens=32, temperature=0, stop=" Paris")
    whole = sdk.chat.completions.create(**kwargs)
    chunks = list(sdk.chat.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert "Paris" not in text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_completion_tokens_limits_the_answer(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 3
    assert reply.choices[0].finish_reason == "length"


def test_default_max_tokens_fills_the_rest_of_the_context(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    """Without max_tokens the server default (8192) is capped to what the context leaves."""
    messages = [{"role": "user", "content": "Count: " + "one " * 470}]
    prompt_tokens = http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert 1 <= MAX_MODEL_LEN - prompt_tokens <= 40, prompt_tokens
    reply = sdk.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == MAX_MODEL_LEN - prompt_tokens
    assert reply.choices[0].finish_reason == "length"
