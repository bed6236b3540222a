"""Incremental detokenization of one request's output, with stop-string detection.

Decoding uses the prefix/read offset technique (as vLLM does): each new token is decoded together
with a few tokens before it, and only the text past what those earlier tokens already produced is
new. Decoding a window rather than one token at a time is what makes characters split across tokens
(byte-level BPE, byte fallback: emoji, CJK) and decoders that treat the first token specially
(Metaspace / `Strip` leading-space handling) come out exactly as a one-shot decode would.

Invariants kept between calls:
- `_ids[_prefix_offset:_read_offset]` is the last window that produced text; the text of every
  token before `_read_offset` is already in the output. Tokens from `_read_offset` on are pending:
  their text is incomplete (it ends in U+FFFD, a character split across tokens) or empty so far.
- Output text is `_sent` (already returned by `take_delta`) followed by `_unsent`.
- No suffix of the sent text can be the start of a stop string, so a stop match always starts
  inside `_unsent` and cutting it never takes back text a client has seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as left context for the first output token (vLLM uses the same count).
_PREFIX_CONTEXT = 5
# Consumed ids are dropped in batches once the window has moved this far, keeping memory and the
# cost of slicing bounded by the window rather than the output length.
_TRIM_AT = 512
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, and finds stop strings.

    Text matches `tokenizer.decode(output_ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)` once `flush` has run, except that the first output token
    is decoded with the prompt's last tokens as context: for decoders that strip the leading space
    of the first token (Llama/Metaspace style) the output keeps the space a continuation of the
    prompt has, as vLLM's does. Byte-level BPE decoders have no such special case. One more known
    difference, shared with vLLM: byte-fallback decoders render a run of byte tokens that is partly
    invalid UTF-8 as all U+FFFD, including valid characters already streamed from that run.

    When several stop strings match, the one that ends first wins (ties: the longest), which is
    the one a character-by-character stream would have hit first.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        if any(not s for s in self._stop):
            raise ValueError("stop strings must be non-empty")
        self._include_stop = include_stop_str_in_output
        # A match that ends in new text starts at most this many characters before it.
        self._stop_lookback = max((len(s) for s in self._stop), default=1) - 1

        self._ids: list[int] = _prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PREFIX_CONTEXT, 0)
        # Decoded `_ids[_prefix_offset:_read_offset]`; None until needed after the window moves.
        self._prefix_text: str | None = None

        self._sent: list[str] = []
        self._unsent: list[str] = []
        self._unsent_len = 0
        # The last `_stop_lookback` characters of the output, for matches spanning tokens.
        self._tail = ""
        self._matched_stop: str | None = None
        self._flushed = False

    @property
    def text(self) -> str:
        """Full output text so far (cut at a stop); excludes a trailing incomplete character."""
        # Compacting keeps repeated reads linear overall; the joined text is the same.
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]
        if len(self._unsent) > 1:
            self._unsent = ["".join(self._unsent)]
        return "".join(self._sent + self._unsent)

    def text_of(self, token_ids: list[int]) -> str:
        """Some tokens' text alone (as the output shows them: special tokens skipped or not)."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._matched_stop

    @property
    def finished(self) -> bool:
        """True after a stop string matched or `flush` ran; no more tokens are accepted."""
        return self._matched_stop is not None or self._flushed

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token. Returns None if no stop string was hit, else the matched
        stop string. After a stop, `text` is cut: it ends right before the stop string (or right
        after it when include_stop_str_in_output)."""
        if self.finished:
            raise RuntimeError("add_token called after the output finished (stop string or flush)")
        self._ids.append(token_id)
        new_text = self._decode_pending(force=False)
        if new_text:
            self._append(new_text)
        return self._matched_stop

    def take_delta(self) -> str:
        """Text that became final since the last call.

        Holds back the longest tail that could still grow into a stop string, so a streaming client
        never sees part of a stop string. Incomplete characters (a decode ending in U+FFFD) are
        held back earlier: they stay pending tokens and never enter the text until complete.
        """
        if not self._unsent:
            return ""
        pending = "".join(self._unsent)
        hold = 0 if self.finished else self._stop_prefix_len(pending)
        cut = len(pending) - hold
        delta, kept = pending[:cut], pending[cut:]
        if delta:
            self._sent.append(delta)
        self._unsent = [kept] if kept else []
        self._unsent_len = len(kept)
        return delta

    def flush(self) -> str:
        """At the end of a request: return whatever is still held back (minus any stop string).

        Pending tokens are decoded as they are, so an incomplete character comes out as U+FFFD,
        exactly as a one-shot decode renders it; that text is still checked for stop strings.
        """
        if not self.finished:
            new_text = self._decode_pending(force=True)
            if new_text:
                self._append(new_text)
            self._flushed = True
        return self.take_delta()

    def _decode(self, ids: list[int]) -> str:
        # Cleanup off: it rewrites spaces around punctuation across window edges, which would break
        # the window differencing (and vLLM does not apply it either).
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_pending(self, force: bool) -> str:
        """New text of the pending tokens, advancing the window when there is some.

        Without `force`, text ending in U+FFFD (a character whose remaining bytes are in tokens not
        yet generated) is held: the tokens stay pending and are decoded again with the next one.
        """
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(self._prefix_text):
            return ""  # nothing new yet (a skipped special token, or a merge into pending bytes)
        if not force and full.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = full[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def _append(self, new_text: str) -> None:
        """Add decoded text to the output, cutting it at the first stop string it completes."""
        self._unsent.append(new_text)
        self._unsent_len += len(new_text)
        if not self._stop:
            return
        # Earlier text held no match, so a new one must end in `new_text`; it can start at most
        # `_stop_lookback` characters before it.
        region = self._tail + new_text
        match = _first_stop(region, self._stop)
        if match is None:
            self._tail = region[len(region) - self._stop_lookback :] if self._stop_lookback else ""
            return
        start, stop_str = match
        keep = start + len(stop_str) if self._include_stop else start
        self._truncate(len(region) - keep)
        self._matched_stop = stop_str

    def _truncate(self, count: int) -> None:
        """Remove the last `count` characters of the output; all are unsent (see invariants)."""
        if count > self._unsent_len:
            raise AssertionError("stop match reaches into text already returned by take_delta")
        self._unsent_len -= count
        while count:
            last = self._unsent.pop()
            if len(last) > count:
                self._unsent.append(last[: len(last) - count])
                break
            count -= len(last)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop_str in self._stop:
            for length in range(min(len(stop_str) - 1, len(text)), best, -1):
                if text.endswith(stop_str[:length]):
                    best = length
                    break
        return best


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the match in `text` that ends first; ties go to the longest."""
    best: tuple[int, int, str] | None = None
    for stop_str in stops:
        start = text.find(stop_str)
        if start < 0:
            continue
        key = (start + len(stop_str), start, stop_str)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[1], best[2])


def _prompt_context(
    tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], skip_special_tokens: bool
) -> list[int]:
    """The last `_PREFIX_CONTEXT` prompt ids that decode to text, oldest first.

    Special tokens are left out when they will be skipped, so they do not crowd out the text the
    first output token's leading space depends on. Scans from the end: O(context), not O(prompt),
    unless the prompt is mostly special tokens.
    """
    skipped = _special_ids(tokenizer) if skip_special_tokens else frozenset()
    context: list[int] = []
    for token_id in reversed(prompt_token_ids):
        if token_id in skipped:
            continue
        context.append(token_id)
        if len(context) == _PREFIX_CONTEXT:
            break
    context.reverse()
    return context


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    # `all_special_ids` names only the role tokens (bos, eos, ...); fast tokenizers also skip every
    # added token marked special, which `added_tokens_decoder` lists.
    ids = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    ids.update(token_id for token_id, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)
