"""Encoder embedders and cross-encoders over real HTTP, against sentence-transformers' own
`SentenceTransformer` and `CrossEncoder` on the same tiny checkpoints: text in, the server's
tokenization (the tokenizer's [CLS]/[SEP], a pair's separator and types) through the official
OpenAI SDK, `/v1/rerank` and `/v1/score`; an input that fills the encoder's context is served, one
past it a 400, and the kinds' other endpoints refused by name."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from tests.engine.models.encoder_build import TEXT, tiny_encoder
from tests.engine.server.harness import RunningServer, error_of, running_server

ENGINE = {"dtype": "float32", "block_size": 8}
WORDS = TEXT.split(" ")
TEXTS = ["what is the python function for a file", "code", " ".join(WORDS[:20])]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    out = tmp_path_factory.mktemp("bert-embed")
    tiny_encoder(out, "BertModel", seed=4, pooling="mean")
    with running_server(out, ("mini",), {**ENGINE, "kind": "embed"}) as running:
        yield running


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    out = tmp_path_factory.mktemp("bert-cross")
    tiny_encoder(out, "BertForSequenceClassification", seed=5, labels=1)
    with running_server(out, ("ce",), {**ENGINE, "kind": "rerank"}) as running:
        yield running


def test_embeddings_equal_sentence_transformers(embedder: RunningServer) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(embedder.engine.checkpoint), device="cpu")
    want = reference.encode(TEXTS, convert_to_tensor=True)
    with openai.OpenAI(base_url=f"{embedder.url}/v1", api_key="x", max_retries=0) as sdk:
        answer = sdk.embeddings.create(model="mini", input=TEXTS)
    got = torch.tensor([item.embedding for item in answer.data])
    torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=1e-4)
    embedder.wait_idle()


def test_the_context_is_the_encoders_whole(embedder: RunningServer) -> None:
    tokenizer = embedder.engine.tokenizer
    fits = " ".join(["code"] * 62)  # 62 words + [CLS] + [SEP]: all 64 positions
    assert len(tokenizer(fits).input_ids) == 64
    with httpx.Client(base_url=embedder.url, timeout=60) as http:
        assert http.post("/v1/embeddings", json={"input": fits}).status_code == 200
        over = http.post("/v1/embeddings", json={"input": fits + " code"})
        assert over.status_code == 400 and "context is 64 tokens" in error_of(over)["message"]
        chat = {"model": "mini", "messages": [{"role": "user", "content": "hi"}]}
        refused = http.post("/v1/chat/completions", json=chat)
        assert refused.status_code == 400 and error_of(refused)["code"] == "wrong_model_kind"
    embedder.wait_idle()


def test_rerank_and_score_equal_the_cross_encoder(cross_encoder: RunningServer) -> None:
    from sentence_transformers import CrossEncoder

    query = "python function for a file"
    documents = [" ".join(WORDS[i : i + 4 + i]) for i in range(0, 24, 4)]
    reference = CrossEncoder(str(cross_encoder.engine.checkpoint), device="cpu")
    want = [float(s) for s in reference.predict([(query, d) for d in documents])]
    assert all(0 < s < 1 for s in want)  # a sigmoid: one label
    with httpx.Client(base_url=cross_encoder.url, timeout=60) as http:
        body = {"query": query, "documents": documents, "top_n": 3, "return_documents": True}
        ranked = http.post("/v1/rerank", json=body).json()["results"]
        order = sorted(range(len(want)), key=lambda i: -want[i])[:3]
        assert [r["index"] for r in ranked] == order
        for r in ranked:
            assert abs(r["relevance_score"] - want[r["index"]]) < 2e-5
            assert r["document"]["text"] == documents[r["index"]]
        scored = http.post("/v1/score", json={"text_1": query, "text_2": documents}).json()
        got = [item["score"] for item in scored["data"]]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-5
        told = http.post("/v1/rerank", json={**body, "instruction": "find code"})
        assert told.status_code == 400 and error_of(told)["param"] == "instruction"
    cross_encoder.wait_idle()
