"""The pooling routes over real HTTP: `/v1/embeddings` through the official OpenAI SDK (its
default base64 encoding) and plain JSON, `/v1/rerank`, `/v2/rerank` and `/v1/score`, each against
transformers on the same tiny weights; every bad input a 400 or 404 naming the field or the
endpoint the model serves, the engine idle afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.conftest import TINY_COMMON, build_tiny_checkpoint, build_tiny_embedder
from tests.engine.server.harness import RunningServer, error_of, running_server

ENGINE = {"kv_capacity": 1024, "block_size": 8, "max_model_len": 128, "prefill_chunk_tokens": 16}
QUERY_PROMPT = "Instruct: find the code\nQuery:"
RERANK_TEMPLATE = (  # Qwen3-Reranker's model card
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {task}\n<Query>: {query}\n<Document>: {doc}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
DEFAULT_TASK = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def embed_server(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Iterator[RunningServer]:
    checkpoint = build_tiny_embedder(tmp_path_factory.mktemp("embedder"), tokenizer_dir)
    prompts = {"prompts": {"query": QUERY_PROMPT, "document": ""}}
    (checkpoint / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    with running_server(checkpoint, ("emb",), {**ENGINE, "kind": "embed"}) as running:
        yield running


@pytest.fixture(scope="module")
def rerank_server(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Iterator[RunningServer]:
    out = tmp_path_factory.mktemp("reranker")
    checkpoint = build_tiny_checkpoint(out, tokenizer_dir, "Qwen3ForCausalLM", seed=5)
    with running_server(checkpoint, ("rr",), {**ENGINE, "kind": "rerank"}) as running:
        yield running


def _hidden(server: RunningServer, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.Qwen3Model.from_pretrained(str(server.engine.checkpoint)).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1]


def _unit(values: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(values, dim=0)


def test_embeddings_through_the_openai_sdk_equal_transformers(embed_server: RunningServer) -> None:
    tokenizer = embed_server.engine.tokenizer
    texts = ["def add(a, b): return a + b", "a longer text " * 6]
    with openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="x", max_retries=0) as sdk:
        answer = sdk.embeddings.create(model="emb", input=texts)  # base64 on the wire
    assert [item.index for item in answer.data] == [0, 1]
    ids = [tokenizer(text).input_ids for text in texts]
    assert answer.usage.prompt_tokens == sum(map(len, ids)) == answer.usage.total_tokens
    for item, prompt in zip(answer.data, ids, strict=True):
        want = _unit(_hidden(embed_server, prompt))
        torch.testing.assert_close(torch.tensor(item.embedding), want, atol=2e-5, rtol=1e-4)
    embed_server.wait_idle()


def test_float_token_ids_dimensions_and_input_type(embed_server: RunningServer) -> None:
    tokenizer = embed_server.engine.tokenizer
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        ids = [[400, 401, 402, 403], [9, 8, 7]]
        body = {"input": ids, "encoding_format": "float", "dimensions": 16}
        answer = http.post("/v1/embeddings", json=body).json()
        assert answer["object"] == "list" and answer["model"] == "emb"
        for item, prompt in zip(answer["data"], ids, strict=True):
            want = _unit(_hidden(embed_server, prompt)[:16])  # Matryoshka: cut, then unit length
            assert len(item["embedding"]) == 16
            torch.testing.assert_close(torch.tensor(item["embedding"]), want, atol=2e-5, rtol=1e-4)
        query = http.post("/v1/embeddings", json={"input": "sort a list", "input_type": "query"})
        want = _unit(_hidden(embed_server, tokenizer(QUERY_PROMPT + "sort a list").input_ids))
        got = torch.tensor(query.json()["data"][0]["embedding"])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        plain = http.post("/v1/embeddings", json={"input": "x", "input_type": "document"})
        assert plain.json()["usage"]["prompt_tokens"] == len(tokenizer("x").input_ids)
    embed_server.wait_idle()


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({"input": []}, 400, "input", "input is empty"),
        ({"input": [""]}, 400, "input", "input 0 is empty"),
        ({"input": 5}, 400, "input", "input"),
        ({"input": [[1, 2], "x"]}, 400, "input", "input"),
        ({"input": [10**9]}, 400, "input", "in [0, 49152)"),
        ({"input": "x " * 200}, 400, "input", "context is 128 tokens"),
        ({"input": "x", "dimensions": 0}, 400, "dimensions", "dimensions"),
        ({"input": "x", "dimensions": 65}, 400, "dimensions", "1 to 64"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", "encoding_format"),
        ({"input": "x", "input_type": "code"}, 400, "input_type", "known: document, passage"),
        ({"input": [1, 2], "input_type": "query"}, 400, "input_type", "token ids"),
        ({"input": "x", "model": "other"}, 404, "model", "serves 'emb'"),
        ({"input": "x", "priority": "high"}, 400, "priority", "priority"),
    ],
)
def test_bad_embedding_requests_name_the_field(
    embed_server: RunningServer, body: dict, status: int, param: str | None, says: str
) -> None:
    answer = httpx.post(f"{embed_server.url}/v1/embeddings", json=body, timeout=60)
    assert answer.status_code == status, answer.text
    error = error_of(answer)
    assert says in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    embed_server.wait_idle()


def test_each_kind_refuses_the_others_endpoints_naming_its_own(
    embed_server: RunningServer, rerank_server: RunningServer
) -> None:
    chat = {"model": "emb", "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(f"{embed_server.url}/v1/chat/completions", json=chat, timeout=60)
    assert answer.status_code == 400
    error = error_of(answer)
    assert error["code"] == "wrong_model_kind" and "POST /v1/embeddings" in error["message"]
    messages = {"max_tokens": 4, **chat}
    anthropic = httpx.post(f"{embed_server.url}/v1/messages", json=messages, timeout=60)
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert "/v1/embeddings" in anthropic.json()["error"]["message"]
    answer = httpx.post(f"{rerank_server.url}/v1/embeddings", json={"input": "x"}, timeout=60)
    assert answer.status_code == 400 and "/v1/rerank" in error_of(answer)["message"]
    rerank = {"query": "q", "documents": ["d"]}
    answer = httpx.post(f"{embed_server.url}/v1/rerank", json=rerank, timeout=60)
    assert answer.status_code == 400 and "'rerank' model" in error_of(answer)["message"]


def _reference_scores(server: RunningServer, pairs: list[tuple[str, str]], task: str) -> list:
    import transformers

    tokenizer = server.engine.tokenizer
    no, yes = (tokenizer.encode(word, add_special_tokens=False)[0] for word in ("no", "yes"))
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(server.engine.checkpoint)).eval()
    scores = []
    for query, doc in pairs:
        text = RERANK_TEMPLATE.format(task=task, query=query, doc=doc)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1, [no, yes]]
        scores.append(float(torch.softmax(logits, dim=0)[1]))
    return scores


def test_rerank_v1_v2_and_score_equal_transformers(rerank_server: RunningServer) -> None:
    query, docs = "how to sort", ["sorted(xs)", "print(1)", "xs.sort()", "open a file"]
    want = _reference_scores(rerank_server, [(query, doc) for doc in docs], DEFAULT_TASK)
    order = sorted(range(len(docs)), key=lambda index: -want[index])
    with httpx.Client(base_url=rerank_server.url, timeout=60) as http:
        for path in ("/v1/rerank", "/v2/rerank"):
            body = {"model": "rr", "query": query, "documents": docs, "top_n": 3}
            answer = http.post(path, json=body).json()
            assert [item["index"] for item in answer["results"]] == order[:3]
            for item in answer["results"]:
                assert item["document"] == {"text": docs[item["index"]]}
                assert item["relevance_score"] == pytest.approx(want[item["index"]], abs=1e-5)
        bare = {"query": query, "documents": [{"text": docs[0]}], "return_documents": False}
        (only,) = http.post("/v1/rerank", json=bare).json()["results"]
        assert only == {"index": 0, "relevance_score": pytest.approx(want[0], abs=1e-5)}
        task = "Judge code snippets"
        pairs = {"text_1": ["a", "b"], "text_2": ["c", "d"], "instruction": task}
        scored = http.post("/v1/score", json=pairs).json()
        expected = _reference_scores(rerank_server, [("a", "c"), ("b", "d")], task)
        assert [item["score"] for item in scored["data"]] == pytest.approx(expected, abs=1e-5)
        bad = http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"]})
        assert bad.status_code == 400 and error_of(bad)["param"] == "text_2"
        empty = http.post("/v1/rerank", json={"query": "q", "documents": []})
        assert empty.status_code == 400 and error_of(empty)["param"] == "documents"
        long = http.post("/v1/rerank", json={"query": "q", "documents": ["x " * 200]})
        assert long.status_code == 400 and "context is 128" in error_of(long)["message"]
    rerank_server.wait_idle()
    assert TINY_COMMON["hidden_size"] == 64  # the dimensions cases above assume it
