"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from dgpp.engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
PRIORITY_RANGE = (-1000, 1000)  # a request's priority: lower runs first (vLLM's order)
MAX_SESSION_ID = 256


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    `temperature == 0` is greedy decoding. `top_k <= 0` and `top_p == 1` disable those filters.
    `logprobs=None` returns none; `logprobs=n` returns the chosen token's log-probability and the
    `n` most likely alternatives (OpenAI's `top_logprobs`). Log-probabilities are those of the
    model's raw distribution, before penalties, bias and filters, as vLLM reports them.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # The prompt's tokens' log-probabilities (each under the positions before it; the first has
    # none) with this many alternatives: evaluation clients' loglikelihoods (vLLM's name).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # llguidance grammar text (dgpp.engine.sampling.grammar): the output must match it.
    grammar: str | None = None
    # At most this many tokens of reasoning (the output starts in a reasoning block that
    # `reasoning_end` closes): dgpp.engine.sampling.reasoning_budget.
    reasoning_budget: int | None = None
    reasoning_end: tuple[int, ...] = ()
    reasoning_open: tuple[int, ...] = ()  # the output opens the block itself with these
    reasoning_close: tuple[int, ...] = ()  # the model's own close, where shorter than the end
    # Scheduling order: lower runs first (admission, the prefill budget, who is preempted last);
    # dgpp.engine.scheduling.priority.
    priority: int = 0
    # The agent session whose cached blocks it uses and keeps (dgpp.engine.cache.sessions).
    session: str | None = None

    def __post_init__(self) -> None:
        # Accept the list / str forms callers naturally write, store immutable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        for name in ("reasoning_end", "reasoning_open", "reasoning_close"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        def fail(param: str, message: str) -> None:
            raise InvalidRequestError(message, param=param)

        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
        ):
            fail("max_tokens", f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            )
        if not 0.0 < self.repetition_penalty <= 10.0:
            fail(
                "repetition_penalty",
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_TOP_LOGPROBS
            ):
                fail(name, f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            fail("seed", f"seed must be an integer, got {self.seed!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                fail("stop", "stop strings must be non-empty strings")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                fail(
                    "stop_token_ids",
                    f"stop token ids must be non-negative integers, got {token_id!r}",
                )
        if self.reasoning_budget is not None and (
            isinstance(self.reasoning_budget, bool)
            or not isinstance(self.reasoning_budget, int)
            or self.reasoning_budget < 0
            or not self.reasoning_end
        ):
            fail(
                "reasoning_budget",
                "reasoning_budget must be a non-negative integer, with the reasoning_end ids",
            )
        low, high = PRIORITY_RANGE
        if (
            isinstance(self.priority, bool)
            or not isinstance(self.priority, int)
            or not low <= self.priority <= high
        ):
            fail(
                "priority", f"priority must be an integer in [{low}, {high}], got {self.priority!r}"
            )
        if self.session is not None and (
            not isinstance(self.session, str) or not 0 < len(self.session) <= MAX_SESSION_ID
        ):
            fail("session", f"a session id is a string of 1 to {MAX_SESSION_ID} characters")
        for token_id, bias in (self.logit_bias or {}).items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                fail("logit_bias", f"logit_bias keys must be token ids, got {token_id!r}")
            if not -100.0 <= bias <= 100.0:
                fail("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")
