"""A pooling engine's step (`engine.kind` embed or rerank). A request's prompt is read as a
generating request's is: in chunks, with prefix-cache hits, batched with the other requests. Its
last position's row is the result, and no token is drawn:
- an embedding model (`dgpp.engine.models.pooling`): the final hidden state, as float32;
- a decoder reranker (Qwen3-Reranker): the probability of "yes" against "no" at the next token,
  `softmax(logits[no], logits[yes])[1]`, which is the sigmoid of their difference (the
  sequence-classification head that the checkpoint's two rows make);
- an encoder cross-encoder (bge-reranker, `models.bert`): its classifier's logit through a
  sigmoid (one label, sentence-transformers' CrossEncoder default), or the second label's
  probability (two).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dgpp.engine.errors import ConfigError
from dgpp.engine.scheduling.request import Request
from dgpp.engine.scheduling.scheduler import StepPlan

# The answer tokens of a decoder reranker's prompt (Qwen3-Reranker's template asks for them).
SCORE_TOKENS = ("no", "yes")


@dataclass(frozen=True)
class Pooling:
    """What a pooling engine keeps of a request's last row."""

    kind: str  # "embed" or "rerank"
    score_ids: tuple[int, int] | None = None  # a reranker's ("no", "yes") token ids
    classifier: bool = False  # an encoder's classifier logits

    def value(self, row: torch.Tensor) -> tuple[float, ...]:
        if self.classifier:
            logits = row.float()
            if logits.numel() == 1:
                return (float(torch.sigmoid(logits[0])),)
            return (float(torch.softmax(logits, dim=0)[-1]),)
        if self.score_ids is None:
            return tuple(row.float().tolist())
        pair = row[list(self.score_ids)].float()
        return (float(torch.softmax(pair, dim=0)[1]),)


def pooling_for(kind: str, tokenizer: Any, encoder: bool = False) -> Pooling | None:
    """The pooling of an engine serving `kind`; None for a generating one. A decoder reranker
    needs single tokens for "no" and "yes" in its vocabulary; an `encoder` one classifies."""
    if kind == "generate":
        return None
    if kind == "embed":
        return Pooling(kind)
    if encoder:
        return Pooling(kind, classifier=True)
    ids = []
    for word in SCORE_TOKENS:
        found = tokenizer.encode(word, add_special_tokens=False)
        if len(found) != 1:
            raise ConfigError(
                f"a reranker answers with the single tokens {SCORE_TOKENS}; this tokenizer "
                f"spells {word!r} as {found}"
            )
        ids.append(found[0])
    return Pooling(kind, (ids[0], ids[1]))


def pooled_rows(
    plan: StepPlan, logits: torch.Tensor, pooling: Pooling
) -> Iterator[tuple[Request, tuple[float, ...]]]:
    """Each request of `plan` whose prompt this step finished, with its result."""
    offset = 0
    for chunk in plan.chunks:
        if chunk.num_sampled:
            yield chunk.request, pooling.value(logits[offset + chunk.num_sampled - 1])
        offset += chunk.num_sampled
    assert offset == logits.shape[0], "the step's rows do not match its plan"


def embedding(pooled: tuple[float, ...], dimensions: int | None = None) -> list[float]:
    """An embedding model's result as served: its first `dimensions` values (a Matryoshka
    model's shorter embedding; all by default), scaled to unit length."""
    values = torch.tensor(pooled[:dimensions] if dimensions else pooled, dtype=torch.float32)
    return torch.nn.functional.normalize(values, dim=0).tolist()
