"""Scoring a text through the engine's own prefill path, for `dgpp eval perplexity` and `kld`.

The text's tokens are read in windows of `context` tokens started every `stride` tokens; each
window is one request with `prompt_logprobs` (chunked prefill, the deployment's precision and
quantization, no prefix-cache reads), and scores only the tokens no earlier window scored, so
every token after the first is scored once, with at least `context - stride` tokens before it
(all of them in the first window). The request's score sink (`Request.score_sink`) hands the
raw logits of each chunk to a `Collector`, which turns them into float32 log-probabilities
`SCORE_ROWS` positions at a time and keeps, per scored token: its negative log-likelihood, the
most likely token, and (for a reference) the top K log-probabilities, or (against one) the KL
divergence from the reference's distribution.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgpp.engine.engine import LLMEngine
from dgpp.engine.errors import ConfigError
from dgpp.engine.planning.memory_plan import SCORE_ROWS
from dgpp.engine.sampling.sampling_params import SamplingParams

REST_FLOOR = 1e-6  # of probability mass: below it, the rest bucket is rounding
Progress = Callable[[int, int, float], None]  # (tokens scored, of, seconds so far)


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) of the text as one request; it scores tokens [first, end)."""

    begin: int
    end: int
    first: int


def windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows that score tokens 1..num_tokens-1 once each (token 0 has no context)."""
    if context < 2:
        raise ConfigError(f"--context must be at least 2 tokens, got {context}", param="context")
    if not 1 <= stride <= context - 1:
        raise ConfigError(
            f"--stride must be in [1, {context - 1}] (below --context {context}), got {stride}",
            param="stride",
        )
    result: list[Window] = []
    scored_to, begin = 1, 0
    while True:
        end = min(begin + context, num_tokens)
        if end > scored_to:
            result.append(Window(begin, end, max(scored_to, begin + 1)))
            scored_to = end
        if end >= num_tokens:
            return result
        begin += stride


@dataclass
class Reference:
    """A reference run's top-K log-probabilities per scored token (row t - 1 for token t)."""

    top_ids: torch.Tensor  # [N - 1, K] int64
    top_logprobs: torch.Tensor  # [N - 1, K] float32
    token_logprobs: torch.Tensor  # [N - 1] float32, the text's own tokens


class Collector:
    """Per-token results of one scored text (arrays indexed by token - 1)."""

    def __init__(self, tokens: list[int], top_k: int = 0, reference: Reference | None = None):
        n = len(tokens) - 1
        self.tokens = torch.tensor(tokens, dtype=torch.int64)
        self.nll = torch.full((n,), float("nan"))
        self.top1 = torch.zeros(n, dtype=torch.int64)
        self.top_k, self.reference = top_k, reference
        self.top_ids = torch.zeros(n, top_k, dtype=torch.int64)
        self.top_logprobs = torch.zeros(n, top_k)
        self.kl = torch.zeros(n if reference is not None else 0)
        self.scored = 0

    def sink(self, window: Window) -> Callable[[int, torch.Tensor], None]:
        """The score sink of `window`'s request: position p's logits predict token p + 1."""

        def consume(first: int, logits: torch.Tensor) -> None:
            for begin in range(0, logits.shape[0], SCORE_ROWS):
                rows = logits[begin : begin + SCORE_ROWS]
                target = window.begin + first + begin  # the text's token the first row predicts
                skip = max(0, window.first - target)
                if skip < rows.shape[0]:
                    self._add(target + skip, rows[skip:])

        return consume

    def _add(self, target: int, rows: torch.Tensor) -> None:
        logprobs = rows.to(torch.float32).log_softmax(dim=-1).cpu()  # [n, V]
        at = slice(target - 1, target - 1 + logprobs.shape[0])
        own = self.tokens[target : target + logprobs.shape[0]]
        self.nll[at] = -logprobs.gather(1, own.unsqueeze(1)).squeeze(1)
        self.top1[at] = logprobs.argmax(dim=-1)
        if self.top_k:
            values, ids = logprobs.topk(self.top_k, dim=-1)
            self.top_ids[at], self.top_logprobs[at] = ids, values
        if self.reference is not None:
            ids = self.reference.top_ids[at]
            self.kl[at] = coarse_kl(self.reference.top_logprobs[at], logprobs.gather(1, ids))
        self.scored += logprobs.shape[0]


def coarse_kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row over the reference's top K tokens and one bucket for the rest, from
    both distributions' log-probabilities of those tokens [n, K]: exact for the coarsened
    distributions and never above the full KL (the data-processing inequality); the gap is the
    divergence inside the reference's tail, which holds 1 - sum(top K) of its mass."""
    reference, other = reference.double(), other.double()
    p = reference.exp()
    top = (p * (reference - other)).sum(dim=-1)
    p_rest = 1 - p.sum(dim=-1)
    q_rest = (1 - other.exp().sum(dim=-1)).clamp(min=REST_FLOOR)
    # A rest below REST_FLOOR is the float32 log-probabilities' rounding, not mass.
    kept = p_rest > REST_FLOOR
    p_rest = p_rest.clamp(min=REST_FLOOR)
    rest = p_rest * (p_rest.log() - q_rest.log())
    rest = torch.where(kept, rest, 0)
    return (top + rest).float()


def score_text(
    engine: LLMEngine,
    collector: Collector,
    spans: list[Window],
    progress: Progress | None = None,
) -> float:
    """Run every window through `engine`; the seconds it took."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    tokens = collector.tokens.tolist()
    run = uuid.uuid4().hex[:8]
    pending: set[str] = set()
    started = time.monotonic()
    try:
        for i, window in enumerate(spans):
            request_id = f"eval-{run}-{i}"
            ids = tokens[window.begin : window.end]
            request = engine.add_request(ids, params, request_id, use_prefix_cache=False)
            request.score_sink = collector.sink(window)
            pending.add(request_id)
        total = sum(window.end - window.first for window in spans)
        while pending:
            for output in engine.step():
                if output.finished:
                    pending.discard(output.request_id)
            if progress is not None:
                progress(collector.scored, total, time.monotonic() - started)
    finally:
        for request_id in pending:  # interrupted: leave no work behind
            engine.abort(request_id)
    return time.monotonic() - started
