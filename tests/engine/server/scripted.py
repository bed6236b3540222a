"""A stand-in engine that replays a fixed text, for paths a real model cannot be made to take."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from dgpp.engine.sampling.grammar import Grammars
from dgpp.engine.sampling.sampling_defaults import SamplingDefaults
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput


def engine_core(tokenizer: Any) -> SimpleNamespace:
    """The attributes of `LLMEngine` the HTTP layer reads, for fake `AsyncEngine`s (a model's
    vocabulary holds every token of its tokenizer, markers added by a test included)."""
    vocab_size = max(49152, len(tokenizer))
    return SimpleNamespace(
        tokenizer=tokenizer,
        max_model_len=512,
        model_config=SimpleNamespace(vocab_size=vocab_size),
        config=SimpleNamespace(max_concurrency=4, kind="generate"),
        has_recurrent_state=False,
        sampling_defaults=SamplingDefaults(),
        grammars=Grammars(tokenizer, vocab_size, (2,)),
    )


class FakeAdmission:
    """What `AsyncEngine.admit` returns, for fakes that keep no queue."""

    def __init__(self, num_requests: int) -> None:
        self.remaining = num_requests

    def release(self) -> None:
        self.remaining = 0


class ScriptedEngine:
    """Replays `text` in small, uneven pieces (tags split across them), finishing with 'stop'."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.engine = engine_core(tokenizer)
        self.text = text
        self.is_running = True
        self.failure = None
        self.params: list[SamplingParams] = []  # each request's, in arrival order

    def admit(self, num_requests: int = 1) -> FakeAdmission:
        return FakeAdmission(num_requests)

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        use_prefix_cache: bool = True,
        admission: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        self.params.append(params)
        sizes = [3, 1, 7, 2, 5]
        start, step = 0, 0
        while start < len(self.text):
            end = min(len(self.text), start + sizes[step % len(sizes)])
            done = end == len(self.text)
            completion = CompletionOutput(
                index=0,
                text=self.text[:end],
                token_ids=tuple(range(step + 1)),
                finish_reason="stop" if done else None,
            )
            yield RequestOutput(
                request_id, None, tuple(prompt), (completion,), done, self.text[start:end], 1
            )
            start, step = end, step + 1
