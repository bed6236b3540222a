"""Batched token sampler: logit processing, filtering and the exponential-race draw.

One call handles one decode step for a whole batch. Per row, in order: logit_bias (add) ->
repetition penalty (prompt + output tokens, HF/vLLM) -> frequency/presence penalties (output tokens,
OpenAI) -> greedy rows take the argmax -> temperature -> top_k -> top_p -> min_p -> sample.
Log-probabilities are always those of the raw logits, as vLLM reports them.

Everything is vectorised over the batch, and each stage runs only when some row asks for it, so the
all-greedy and plain-temperature paths cost little more than one argmax / softmax per step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from dgpp.engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerRow:
    """What the sampler needs to know about one request for one step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Per-request generator when params.seed is set, else None. It must live on the logits' device.
    generator: torch.Generator | None


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the chosen token under the raw distribution, and the best alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the chosen token in the raw distribution
    # The params.logprobs most likely (token_id, logprob) pairs, best first.
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SamplerOutput:
    """One step's tokens for a batch, in row order."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
    """Add each row's logit_bias in place; `logits` is [B, V]. Returns `logits`.

    Bias entries for ids >= V are dropped: no such token can be sampled, and checking ids against
    the vocabulary belongs to request admission, not to a step that serves the whole batch.
    """
    vocab = logits.shape[1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            if token_id < vocab:
                row_ids.append(i)
                token_ids.append(token_id)
                values.append(float(bias))
    if not row_ids:
        return logits
    device = logits.device
    # Dict keys are unique, so no (row, token) pair repeats; accumulate=True makes this an add.
    logits.index_put_(
        (
            torch.tensor(row_ids, dtype=torch.long, device=device),
            torch.tensor(token_ids, dtype=torch.long, device=device),
        ),
        torch.tensor(values, dtype=logits.dtype, device=device),
        accumulate=True,
    )
    return logits


def _flat_positions(
    row_ids: Sequence[int], seqs: Sequence[Iterable[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """Positions `row * vocab + token` in a flattened [B, vocab] tensor, one per token: [N] long."""
    lengths: list[int] = []
    tokens: list[int] = []
    for seq in seqs:
        before = len(tokens)
        tokens.extend(seq)
        lengths.append(len(tokens) - before)
    flat = torch.tensor(tokens, dtype=torch.long, device=device)  # [N]
    rows = torch.repeat_interleave(
        torch.tensor(row_ids, dtype=torch.long, device=device),
        torch.tensor(lengths, dtype=torch.long, device=device),
    )  # [N]
    # Ids outside the vocabulary have no logit to penalise; dropping them keeps indexing legal.
    keep = (flat >= 0) & (flat < vocab)
    return rows[keep] * vocab + flat[keep]


def _per_row(values: Sequence[float], rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`values[row]` for each entry of `rows`, as a tensor of `like`'s dtype and device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[rows]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties in place; `logits` is contiguous [B, V].

    Repetition (HF/vLLM): for tokens seen in the prompt or output, a positive logit is divided by
    the penalty and a non-positive one multiplied by it. Frequency/presence (OpenAI), over output
    tokens only: logit -= frequency_penalty * count + presence_penalty * (count > 0).
    Returns `logits`.

    Only (row, token) pairs that occur in a sequence can change, so this works on those sparse
    positions rather than dense [B, V] count tensors: the cost scales with the tokens seen, not
    with batch * vocab.
    """
    params = [row.params for row in rows]
    repeat = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    additive = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if not (repeat or additive):
        return logits
    vocab = logits.shape[1]
    flat = logits.view(-1)  # [B * V], shares storage so writes land in `logits`

    if repeat:
        seen = _flat_positions(
            repeat,
            [itertools.chain(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in repeat],
            vocab,
            logits.device,
        )  # [P]; a repeated position is written twice with the same value, so once in effect
        penalty = _per_row([p.repetition_penalty for p in params], seen // vocab, flat)  # [P]
        values = flat[seen]  # [P]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)

    if additive:
        positions, counts = _flat_positions(
            additive, [rows[i].output_token_ids for i in additive], vocab, logits.device
        ).unique(return_counts=True)  # [O] each
        owner = positions // vocab  # [O]
        frequency = _per_row([p.frequency_penalty for p in params], owner, flat)  # [O]
        presence = _per_row([p.presence_penalty for p in params], owner, flat)  # [O]
        # Every listed position occurs at least once, so (count > 0) is 1 for all of them.
        flat[positions] -= frequency * counts.to(flat.dtype) + presence

    return logits


# A top_p-only row first looks for its nucleus among this many most likely tokens; a partial topk
# is an order of magnitude cheaper than a full-vocab sort on CPU. Flat rows fall back to the sort.
NUCLEUS_CANDIDATES = 1024


def _apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Mask tokens outside each row's top_k, then outside its top_p nucleus, in place; [S, V].

    top_k keeps exactly k tokens (ties at the boundary broken by position, as a sort would).
    """
    device = logits.device
    num_rows, vocab = logits.shape
    # top_k <= 0 or >= V disables the filter for that row; top_p == 1 disables it.
    k_per_row = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    has_k = [k < vocab for k in k_per_row]
    has_p = [p.top_p < 1.0 for p in params]
    if not (any(has_k) or any(has_p)):
        return
    p_only = [hp and not hk for hp, hk in zip(has_p, has_k, strict=True)]
    top_p = torch.tensor(
        [p.top_p if p.top_p < 1.0 else math.inf for p in params], dtype=logits.dtype, device=device
    ).unsqueeze(1)  # [S, 1]; inf is never reached, so rounding can't trim a top_p == 1 row
    only = torch.tensor(p_only, device=device).unsqueeze(1)  # [S, 1]

    # Survivors lie within the row's top k, or (usually) its first NUCLEUS_CANDIDATES tokens.
    width = max(
        k if hk else NUCLEUS_CANDIDATES if po else 1
        for k, hk, po in zip(k_per_row, has_k, p_only, strict=True)
    )
    partial = width < vocab
    if partial:
        sorted_logits, sorted_index = logits.topk(width, dim=-1)  # [S, W] each, descending
        if any(p_only):
            row_norm = logits.logsumexp(dim=-1, keepdim=True)  # [S, 1]
            # Tokens past the candidates are all dropped iff the candidates' mass reaches top_p.
            mass = (sorted_logits.logsumexp(dim=-1, keepdim=True) - row_norm).exp()  # [S, 1]
            partial = bool(((mass >= top_p) | ~only).all())
    if not partial:
        width = vocab
        sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)  # [S, V] each

    if any(has_k):
        positions = torch.arange(width, device=device).expand(num_rows, width)  # [S, W]
        k = torch.tensor(k_per_row, dtype=torch.long, device=device).unsqueeze(1)  # [S, 1]
        sorted_logits.masked_fill_(positions >= k, -math.inf)
    if any(has_p):
        # Normalise over the top_k survivors, all among the candidates; a partial top_p-only row
        # normalises over its whole row, whose tail lies beyond them.
        norm = sorted_logits.logsumexp(dim=-1, keepdim=True)  # [S, 1]
        if partial and any(p_only):
            norm = torch.where(only, row_norm, norm)
        sorted_probs = (sorted_logits - norm).exp()  # [S, W]
        # Mass strictly before each position: a token is kept while it is below top_p, which
        # keeps the smallest prefix reaching top_p and always the top token (mass 0 < top_p).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [S, W]
        sorted_logits.masked_fill_(mass_before >= top_p, -math.inf)

    if not partial:
        logits.scatter_(1, sorted_index, sorted_logits)
        return
    # Filtered rows are cut to their candidates; rows with neither filter keep every token.
    filtered = torch.full_like(logits, -math.inf).scatter_(1, sorted_index, sorted_logits)
    limited = [hk or hp for hk, hp in zip(has_k, has_p, strict=True)]
    if all(limited):
        logits.copy_(filtered)
    else:
        keep = torch.tensor(limited, device=device).unsqueeze(1)  # [S, 1]
        torch.where(keep, filtered, logits, out=logits)


def apply_temperature_and_filters(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """Temperature, then top_k, top_p and min_p, in place on non-greedy rows; `logits` is [S, V].

    Filtered tokens become -inf. Every filter keeps at least the most likely token, so each row
    keeps a finite maximum. Returns `logits`.
    """
    device = logits.device
    if any(p.temperature != 1.0 for p in params):
        temperature = torch.tensor(
            [p.temperature for p in params], dtype=logits.dtype, device=device
        ).unsqueeze(1)  # [S, 1]
        logits.div_(temperature)

    _apply_top_k_top_p(logits, params)

    if any(p.min_p > 0.0 for p in params):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); log(0) = -inf masks nothing.
        # The ratio to the top token is unchanged by the renormalisation after top_k/top_p.
        log_min_p = torch.tensor(
            [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params],
            dtype=logits.dtype,
            device=device,
        ).unsqueeze(1)  # [S, 1]
        threshold = logits.amax(dim=-1, keepdim=True) + log_min_p  # [S, 1]
        logits.masked_fill_(logits < threshold, -math.inf)
    return logits


def process_logits(
    logits: torch.Tensor, rows: Sequence[SamplerRow], vocab_size: int
) -> torch.Tensor:
    """The full processing pipeline on a fresh float32 copy: [B, V_padded] -> [B, vocab_size].

    Padded columns beyond vocab_size are cut off, so nothing downstream can pick them. Greedy rows
    stop after bias and penalties (argmax of these values is their token); the other rows also get
    temperature and filters, so their softmax is the distribution they sample from.
    """
    # Every later stage mutates this copy in place (the caller's logits stay untouched), and
    # apply_penalties needs it contiguous to view it flat.
    work = logits[:, :vocab_size].to(dtype=torch.float32, copy=True).contiguous()  # [B, V]
    apply_logit_bias(work, rows)
    apply_penalties(work, rows)
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if len(sampled) == len(rows):
        apply_temperature_and_filters(work, [row.params for row in rows])
    elif sampled:
        index = torch.tensor(sampled, dtype=torch.long, device=work.device)
        sub = apply_temperature_and_filters(
            work.index_select(0, index), [rows[i].params for i in sampled]
        )
        work.index_copy_(0, index, sub)
    return work


def _exponential_race(
    logits: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Sample one token per row of `logits` [S, V]: argmax(probs / q) with q ~ Exp(1). Returns [S].

    A row with its own generator draws its q from it alone, so its token depends only on its
    logits and its generator's state, never on the rest of the batch.
    """
    probs = logits.softmax(dim=-1)  # [S, V]
    # q = -log(u) with u ~ U[0, 1) is Exp(1), and several times cheaper on CPU than exponential_.
    # u < 1 keeps q > 0, so a filtered token's 0 / q stays 0 and can never win; u == 0 gives
    # q = inf, which just makes that token lose.
    u = torch.empty_like(probs)  # [S, V]
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        u.uniform_(generator=default_generator)
    else:
        for i, generator in enumerate(generators):
            if generator is not None:
                u[i].uniform_(generator=generator)
        if shared:
            index = torch.tensor(shared, dtype=torch.long, device=u.device)
            draws = torch.empty(len(shared), u.shape[1], dtype=u.dtype, device=u.device)
            u.index_copy_(0, index, draws.uniform_(generator=default_generator))
    q = u.log_().neg_()  # [S, V]
    return probs.div_(q).argmax(dim=-1)


def scored_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, n: int) -> list[TokenLogprobs]:
    """Each row's log-probability of `token_ids` [B] under raw logits [B, V] (float32), its
    rank (vLLM's: 1 + the tokens strictly more likely) and the `n` best alternatives."""
    logprobs = raw.to(torch.float32).log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_values, top_ids = logprobs.topk(min(n, logprobs.shape[1]), dim=-1)
    return [
        TokenLogprobs(token, value, rank, tuple(zip(ids, values, strict=True)))
        for token, value, rank, ids, values in zip(
            token_ids.tolist(),
            chosen.squeeze(1).tolist(),
            ranks,
            top_ids.tolist(),
            top_values.tolist(),
            strict=True,
        )
    ]


def _logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplerRow]
) -> list[TokenLogprobs | None]:
    """Raw-distribution logprobs for rows that asked; `raw` is [B, V], `token_ids` is [B]."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    index = torch.tensor(wanted, dtype=torch.long, device=raw.device)
    top_n = max(rows[i].params.logprobs or 0 for i in wanted)
    chosen = scored_logprobs(raw.index_select(0, index), token_ids.index_select(0, index), top_n)
    for i, entry in zip(wanted, chosen, strict=True):
        result[i] = replace(entry, top=entry.top[: rows[i].params.logprobs or 0])
    return result


class Sampler:
    """Picks the next token for every row of a batch; stateless apart from the vocab size."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        # Logits may carry padded columns past this (TP-friendly widths); they are never sampled.
        self.vocab_size = vocab_size

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplerRow],
        default_generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        """Sample one token per row. `logits` is [B, V_padded], one row per entry of `rows`.

        Rows without their own generator share `default_generator` (torch's global RNG if None).
        Greedy rows never touch any generator.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [batch={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}"
            )
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])

        work = process_logits(logits, rows, self.vocab_size)  # [B, V]
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if len(sampled) == len(rows):
            token_ids = _exponential_race(work, [row.generator for row in rows], default_generator)
        else:
            # Greedy rows' values in `work` are post-penalty, pre-temperature: argmax is their pick.
            token_ids = work.argmax(dim=-1)  # [B]
            if sampled:
                index = torch.tensor(sampled, dtype=torch.long, device=work.device)
                drawn = _exponential_race(
                    work.index_select(0, index),
                    [rows[i].generator for i in sampled],
                    default_generator,
                )
                token_ids.index_copy_(0, index, drawn)

        logprobs = _logprobs(logits[:, : self.vocab_size], token_ids, rows)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)
