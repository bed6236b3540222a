"""Structured outputs: grammars compiled by llguidance, one token mask per step.

A request's `SamplingParams.grammar` is llguidance grammar text (built here from a JSON schema,
"any JSON object", or a Lark grammar, and checked when the request is made). Rank 0 gives such a
request a matcher when it is added; each step, the sampler masks the logits of the rows whose
request has one to the tokens the grammar allows, and the matcher consumes every token drawn
(speculative drafts included: a draft token the grammar forbids is never drawn, so verification
stops there). A request without a grammar pays nothing. Once the grammar is complete only the
end-of-turn tokens are allowed.

llguidance over xgrammar, measured on CPU (bench/structured_outputs.py, docs/benchmarks.md): a
nested schema compiles in 1.7 ms against 21.9 ms (agents send new schemas and tools all the
time), the package has no dependencies (xgrammar pulls triton and apache-tvm-ffi), and it takes
Lark grammars with embedded JSON schemas (strict tool calls in the template's own format). Its
masks cost 46 us a token against xgrammar's 7 us: both far under a decode step.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch

from dgpp.engine.errors import InvalidRequestError

log = logging.getLogger(__name__)

# Compact-but-readable JSON, as models write it (`{"a": 1, "b": 2}`), no free whitespace runs.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: Any, param: str) -> str:
    """The grammar of JSON documents that match `schema` (a JSON Schema object)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError("the JSON schema must be an object", param=param)
    import llguidance

    try:
        return str(
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        )
    except (ValueError, TypeError) as err:
        raise InvalidRequestError(f"the JSON schema is not usable: {err}", param=param) from None


def json_object_grammar() -> str:
    """Any JSON object (`response_format: {"type": "json_object"}`)."""
    return json_schema_grammar({"type": "object"}, "response_format")


def lark_grammar(text: str, param: str) -> str:
    import llguidance

    try:
        return str(llguidance.LLMatcher.grammar_from_lark(text))
    except (ValueError, TypeError) as err:
        raise InvalidRequestError(f"the grammar is not usable: {err}", param=param) from None


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Grammars:
    """The llguidance tokenizer of one checkpoint (built on first use: about 0.5 s for a 49K
    vocabulary) and the matchers made from it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer

    def check(self, grammar: str, param: str) -> None:
        """Refuse a grammar llguidance cannot run, naming `param`."""
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer()
        )
        if is_error:
            raise InvalidRequestError(
                f"the grammar is not usable: {'; '.join(messages)}", param=param
            )

    def matcher(self, grammar: str) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar)
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar is not usable: {matcher.get_error()}")
        return matcher


def mask_rows(logits: torch.Tensor, matchers: list[Any]) -> None:
    """Mask, in place, row i of `logits` [len(matchers), V] to what matcher i allows (None:
    leave the row alone)."""
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return
    import llguidance.torch as lltorch

    bitmask = lltorch.allocate_token_bitmask(len(rows), logits.shape[1])
    for slot, row in enumerate(rows):
        lltorch.fill_next_token_bitmask(matchers[row], bitmask, slot)
    with torch.inference_mode():  # the step's logits are inference tensors
        index = torch.tensor(rows, device=logits.device)
        part = logits.index_select(0, index)
        apply_bitmask(part, bitmask.to(logits.device))
        logits.index_copy_(0, index, part)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit in `bitmask` [B, ceil(V/32)] int32 (bit j
    of word w: token 32*w + j) is clear. llguidance's own version is torch.compile'd: its first
    call compiles for about 5 s on CPU, stalling the engine thread (and needs a C++ toolchain);
    this eager one costs 1.06 ms per 8 rows of 49,152 logits on CPU against 0.36 ms compiled
    (bench/structured_outputs.py), on any device, with nothing to compile."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    if allowed.shape[1] < logits.shape[1]:  # tokens past the mask are never allowed
        logits[:, allowed.shape[1] :] = float("-inf")
        logits = logits[:, : allowed.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))


def consume(matcher: Any, token_id: int, request_id: str) -> Any:
    """Advance `matcher` by a drawn token; None (constraint dropped, logged) if it refuses it,
    which masking makes impossible short of a bug."""
    if matcher.consume_token(token_id):
        return matcher
    log.warning(
        "request %s: the grammar refused token %d (%s); it runs unconstrained from here",
        request_id,
        token_id,
        matcher.get_error(),
    )
    return None
