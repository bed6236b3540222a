"""Encoder models (BERT, XLM-RoBERTa) as embedders and cross-encoder rerankers, against
transformers on the same tiny random weights: each prompt's embedding is transformers' final
hidden state pooled as the checkpoint's sentence-transformers pooling says (CLS, mean, last
token) and normalized; a cross-encoder's score is its classifier's logit through a sigmoid (one
label) or the second label's probability (two), BERT's pair typed by its separator. Prompts of
many lengths run together, whole (the prompt budget asked for is smaller than they are), the
longest at the encoder's full context; a world of two equals a world of one; what an encoder
cannot serve is refused by name."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.errors import ConfigError
from tests.engine.models.encoder_build import (
    TEXT,
    tiny_encoder,
    wordpiece_tokenizer,
    write_bert_gguf,
)

TOLERANCE = 2e-5
KNOBS = {"dtype": "float32", "prefill_chunk_tokens": 16, "block_size": 8}


def _prompts(vocab: int, context: int) -> list[list[int]]:
    """[CLS] ... [SEP] prompts of 3, 17, 40 and `context` tokens (ids 2 and 3)."""
    gen = torch.Generator().manual_seed(67)
    body = [torch.randint(5, vocab, (n - 2,), generator=gen).tolist() for n in (3, 17, 40, context)]
    return [[2, *ids, 3] for ids in body]


def _pooled(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    pooled = {"cls": hidden[0], "mean": hidden.mean(0), "last": hidden[-1]}[mode]
    return torch.nn.functional.normalize(pooled, dim=0)


@pytest.mark.parametrize(
    ("architecture", "pooling"),
    [
        ("BertModel", None),
        ("BertModel", "mean"),
        ("XLMRobertaModel", "cls"),
        ("XLMRobertaModel", "last"),
    ],
)
def test_embeddings_equal_transformers(architecture: str, pooling: str | None, tmp_path: Path):
    model = tiny_encoder(tmp_path, architecture, pooling=pooling)
    llm = LLM(str(tmp_path), kind="embed", **KNOBS)
    context = llm.engine.max_model_len
    assert context == 64  # XLM-RoBERTa: 66 positions from pad + 1
    assert llm.engine.config.prefill_chunk_tokens >= context and not llm.engine.config.prefix_cache
    prompts = _prompts(model.config.vocab_size, context)
    got = llm.embed(prompts)
    for prompt, values in zip(prompts, got, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
        want = _pooled(hidden, pooling or "cls")
        assert torch.allclose(torch.tensor(values), want, atol=TOLERANCE), len(prompt)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("architecture", "labels"),
    [("BertForSequenceClassification", 1), ("XLMRobertaForSequenceClassification", 2)],
)
def test_cross_encoders_equal_transformers(architecture: str, labels: int, tmp_path: Path):
    from transformers import AutoTokenizer

    model = tiny_encoder(tmp_path, architecture, labels=labels)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    words = TEXT.split(" ")
    pairs = [(" ".join(words[i : i + 3]), " ".join(words[i + 5 : i + 5 + 2 * i + 1]))
             for i in range(0, 18, 3)]  # fmt: skip
    encoded = [tokenizer(query, document) for query, document in pairs]
    assert any(1 in e["token_type_ids"] for e in encoded)  # BERT's pairs are typed
    types = model.config.type_vocab_size  # XLM-RoBERTa has one: its tokenizer types nothing
    llm = LLM(str(tmp_path), kind="rerank", **KNOBS)
    got = llm.score([list(e["input_ids"]) for e in encoded])
    for e, score in zip(encoded, got, strict=True):
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([e["input_ids"]]),
                token_type_ids=torch.tensor([e["token_type_ids"]]) * (types > 1),
            ).logits[0]
        want = torch.sigmoid(logits[0]) if labels == 1 else torch.softmax(logits, 0)[1]
        assert abs(score - float(want)) < TOLERANCE
    assert len({round(s, 6) for s in got}) > 1  # the pairs score apart


def _encoder_rank(
    rank: int, port: int, checkpoint: str, results: Any, prompts: list[list[int]]
) -> None:
    """A rank of a world of two serving a BERT embedder; rank 0 returns the embeddings."""
    from dgpp.engine.head import Head
    from dgpp.engine.planning.resolved import resolve
    from tests.engine.distributed import test_tensor_parallel as tp

    if rank > 0:
        tp._rank(rank, port, checkpoint, results, {}, ())
        return
    from dgpp.engine.distributed.world_spec import WorldSpec, WorldTimeouts

    timeouts = WorldTimeouts(rendezvous_s=60, control_deadline_s=60)
    spec = WorldSpec(rank=0, port=port, world_size=2, timeouts=timeouts)
    config = EngineConfig(model=checkpoint, kind="embed", **KNOBS)
    head = Head(resolve(config, Path(checkpoint), 2), spec)
    try:
        engine = head.form()
        ids = [engine.add_request(p, SamplingParams(max_tokens=1)).request_id for p in prompts]
        done: dict[str, Any] = {}
        while engine.has_unfinished():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output.pooled
        results.put([done[request_id] for request_id in ids])
    finally:
        head.dissolve(orderly=True)


def test_a_world_of_two_equals_a_world_of_one(tmp_path: Path) -> None:
    from tests.engine.distributed import test_tensor_parallel as tp

    model = tiny_encoder(tmp_path, "BertModel", pooling="mean")
    prompts = _prompts(model.config.vocab_size, 64)
    one = LLM(str(tmp_path), kind="embed", **KNOBS)
    expected = [out.pooled for out in one.generate(prompts, SamplingParams(max_tokens=1))]
    context = mp.get_context("spawn")
    results = context.Queue()
    port = tp._free_port()
    ranks = [
        context.Process(target=_encoder_rank, args=(rank, port, str(tmp_path), results, prompts))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        got = results.get(timeout=180)
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in ranks] == [0, 0]
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_what_an_encoder_cannot_serve_is_refused(tmp_path: Path) -> None:
    tiny_encoder(tmp_path / "bert", "BertModel")
    with pytest.raises(ConfigError, match=r"serves engine\.kind=embed"):
        LLM(str(tmp_path / "bert"), kind="rerank", **KNOBS)
    with pytest.raises(ConfigError, match=r"serves engine\.kind=embed"):
        LLM(str(tmp_path / "bert"), **KNOBS)  # generate
    with pytest.raises(ConfigError, match="exceeds this encoder's 64 positions"):
        LLM(str(tmp_path / "bert"), kind="embed", max_model_len=65, **KNOBS)
    tiny_encoder(tmp_path / "max", "BertModel", pooling="mean")
    pooling = tmp_path / "max" / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="pools by pooling_mode_max_tokens"):
        LLM(str(tmp_path / "max"), kind="embed", **KNOBS)


@pytest.mark.parametrize(("pooling", "mode"), [(1, "mean"), (2, "cls")])
def test_a_bert_gguf_as_llama_cpp_writes_it_equals_transformers(
    pooling: int, mode: str, tmp_path: Path
) -> None:
    """llama.cpp's BERT embedding file (its names, its "▁" vocabulary, F16 weights, its pooling
    type) serves the embeddings transformers gives for the same weights and text."""
    from transformers import AutoTokenizer

    model = tiny_encoder(tmp_path / "hf", "BertModel", seed=9)
    vocab = wordpiece_tokenizer(tmp_path / "hf")
    gguf = write_bert_gguf(model, vocab, tmp_path / "tiny-bert.gguf", pooling)
    llm = LLM(str(gguf), kind="embed", **KNOBS)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    texts = ["what is the python function for a file", "Code, code!", TEXT]
    served = llm.engine.tokenizer
    for text in texts:
        assert served(text).input_ids == tokenizer(text).input_ids
    for name, param in model.named_parameters():  # the file's F16 weights, as the reference's
        if param.ndim == 2 and not name.startswith("embeddings."):
            param.data = param.data.half().float()
    got = llm.embed([tokenizer(t).input_ids for t in texts])
    for text, values in zip(texts, got, strict=True):
        ids = tokenizer(text).input_ids
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        assert torch.allclose(torch.tensor(values), _pooled(hidden, mode), atol=TOLERANCE)
