"""/health, /tokenize and /detokenize on the real server."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.server.conftest import ALIAS, MAX_MODEL_LEN, MODEL
from tests.engine.server.harness import RunningServer, assert_error

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_health_is_serving(http: httpx.Client) -> None:
    response = http.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["state"] == "serving"
    assert body["model"] == MODEL
    assert body["uptime_s"] >= 0
    assert "error" not in body


def test_tokenize_prompt(http: httpx.Client, server: RunningServer) -> None:
    text = "Hello world, this is dgpp."
    body = http.post("/tokenize", json={"prompt": text, "model": ALIAS}).json()
    expected = list(server.engine.tokenizer(text).input_ids)
    assert body == {"tokens": expected, "count": len(expected), "max_model_len": MAX_MODEL_LEN}
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    expected = list(server.engine.tokenizer(text, add_special_tokens=False).input_ids)
    assert plain["tokens"] == expected


def test_tokenize_messages_counts_the_chat_prompt(http: httpx.Client) -> None:
    body = http.post("/tokenize", json={"messages": FRANCE}).json()
    assert body["count"] == len(body["tokens"])
    text = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert "What is the capital of France?" in text
    assert text.endswith("<|im_start|>assistant\n")
    chat = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "max_tokens": 1}
    ).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]
    bare = http.post("/tokenize", json={"messages": FRANCE, "add_generation_prompt": False}).json()
    assert bare["tokens"] == body["tokens"][: bare["count"]]
    assert bare["count"] < body["count"]


@pytest.mark.parametrize("body", [{"prompt": "x", "messages": FRANCE}, {}], ids=["both", "neither"])
def test_tokenize_needs_exactly_one_input(http: httpx.Client, body: dict) -> None:
    assert_error(http.post("/tokenize", json=body), 400, "invalid_value", "prompt")


@pytest.mark.parametrize(
    "text", ["Hello, world!", "  spaces  and\nnewlines\t", "Ünïcödé 你好 🙂", "<|im_start|>user"]
)
def test_detokenize_round_trip(http: httpx.Client, text: str) -> None:
    tokens = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    response = http.post("/detokenize", json={"tokens": tokens, "model": MODEL})
    assert response.status_code == 200
    assert response.json() == {"prompt": text}


def test_detokenize_empty(http: httpx.Client) -> None:
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("tokens", [[1, 49152], [-1], [10**12]])
def test_detokenize_out_of_range_is_400(http: httpx.Client, tokens: list[int]) -> None:
    response = http.post("/detokenize", json={"tokens": tokens})
    error = assert_error(response, 400, "invalid_value", "tokens")
    assert "49152" in error["message"]


def test_detokenize_wrong_type_is_400(http: httpx.Client) -> None:
    response = http.post("/detokenize", json={"tokens": ["a"]})
    assert_error(response, 400, "invalid_type", "tokens.0")
