"""Pooling engines (`engine.kind`) against transformers on the same tiny random weights:
- embed: a bare Qwen3 decoder saved as Qwen3-Embedding is (no `model.` prefix, no head); each
  prompt's embedding is transformers' last-token hidden state, normalized, through prefill chunks
  shorter than the prompt, prompts batched together and a prefix-cache hit;
- rerank: a Qwen3 decoder with its head; P("yes") is softmax over transformers' "no"/"yes"
  logits at the last position.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.errors import ConfigError, InvalidRequestError
from dgpp.engine.scheduling.step_pooling import embedding
from tests.conftest import TINY_COMMON, build_tiny_checkpoint, build_tiny_embedder

PROMPTS = [
    list(range(300, 337)),  # 37 tokens: three chunks of 16
    list(range(300, 330)) + [7, 8, 9],  # shares two blocks with the first
    [5000, 6000, 7000],
]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_embedder(tmp_path_factory.mktemp("tiny-embedding"), tokenizer_dir)


def _reference_embeddings(checkpoint: Path) -> list[torch.Tensor]:
    import transformers

    model = transformers.Qwen3Model.from_pretrained(str(checkpoint)).eval()
    with torch.no_grad():
        return [
            torch.nn.functional.normalize(
                model(torch.tensor([prompt])).last_hidden_state[0, -1], dim=0
            )
            for prompt in PROMPTS
        ]


@pytest.mark.parametrize("chunk", [16, 5])  # three chunks of the longest prompt; eight
def test_embeddings_equal_transformers_last_token_through_chunks_batches_and_cache_hits(
    embedder: Path, chunk: int
) -> None:
    expected = _reference_embeddings(embedder)
    llm = LLM(str(embedder), kind="embed", block_size=8, prefill_chunk_tokens=chunk,
              prefix_min_tokens=0)  # fmt: skip
    assert not hasattr(llm.engine.runner.model.lm_head, "weight")  # no head built or read
    first = llm.embed(PROMPTS)  # together: batched in the same steps
    (hit,) = llm.generate(PROMPTS[1], SamplingParams(max_tokens=1))
    assert hit.num_cached_tokens == 32 and hit.outputs[0].token_ids == ()  # all but its last
    again = [embedding(hit.pooled or ())]
    for got, want in zip([*first, *again], [*expected, expected[1]], strict=True):
        assert len(got) == TINY_COMMON["hidden_size"]
        torch.testing.assert_close(torch.tensor(got), want, atol=2e-5, rtol=1e-4)
        assert abs(torch.tensor(got).norm().item() - 1.0) < 1e-5
    with pytest.raises(InvalidRequestError, match="served as 'embed'"):
        llm.score(PROMPTS[0])


def test_a_bare_decoder_saved_as_qwen3model_loads_as_an_embedder(
    embedder: Path, tmp_path: Path
) -> None:
    """transformers saves `Qwen3Model` under its own architecture name: the same family."""
    import json

    bare = tmp_path / "bare"
    shutil.copytree(embedder, bare)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3Model"]}))
    (want,) = _reference_embeddings(bare)[2:]
    (got,) = LLM(str(bare), kind="embed").embed([PROMPTS[2]])
    torch.testing.assert_close(torch.tensor(got), want, atol=2e-5, rtol=1e-4)


def test_rerank_scores_are_transformers_yes_against_no(tmp_path: Path, tokenizer_dir: Path) -> None:
    import transformers

    checkpoint = build_tiny_checkpoint(tmp_path / "reranker", tokenizer_dir, "Qwen3ForCausalLM")
    llm = LLM(str(checkpoint), kind="rerank", block_size=8, prefill_chunk_tokens=16)
    no, yes = (llm.tokenizer.encode(word, add_special_tokens=False)[0] for word in ("no", "yes"))
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(checkpoint)).eval()
    with torch.no_grad():
        want = [
            torch.softmax(model(torch.tensor([prompt])).logits[0, -1, [no, yes]], dim=0)[1]
            for prompt in PROMPTS
        ]
    got = llm.score(PROMPTS)
    torch.testing.assert_close(torch.tensor(got), torch.stack(want), atol=1e-5, rtol=1e-4)
    assert len(set(got)) == len(got)  # not a constant


def test_a_pooling_kind_refuses_speculative_decoding(embedder: Path) -> None:
    with pytest.raises(ConfigError, match="never decodes"):
        LLM(str(embedder), kind="embed", speculative="ngram")
