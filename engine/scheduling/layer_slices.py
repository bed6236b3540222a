"""Layer slices: a long prompt's chunk computed a few layers per step.

The interactive policy bounds the long prompt work a step holds, so an arrival waits little for
the step in flight (`step_policy`). Cut to fit that bound by tokens alone, a chunk deep in a long
prompt is mostly fixed cost: every step reads every weight once (a CPU's decode step), and a
chunk reads its whole context in every layer, so a 10-token chunk at position 6,000 costs about
what 30 tokens would in one larger chunk. A sliced chunk keeps a size whose fixed costs are small
against its tokens' work, and each step computes only as many of its layers as the bound
allows; the residual stream it leaves is kept on every rank (`ModelRunner`) and the next step
goes on from the next layer. A slice's cost, fixed costs included, is its layers' share of the
whole chunk's, so the bound holds at any position while the long prompt keeps the speed of
large chunks. The chunk's tokens count as computed, enter the prefix cache and are sampled
after its last slice only.

Plain decoders only (`num_slice_layers`): there the residual stream is all a slice hands the
next. Models with hyper-connection streams or recurrent states, and MTP (it reads every step's
last hidden states), keep chunks bounded by tokens.
"""

from __future__ import annotations

from dgpp.engine.scheduling.request import Request
from dgpp.engine.scheduling.step_times import StepTimes


def slice_seconds(times: StepTimes, tokens: int, start: int, layers: int, total: int) -> float:
    """The predicted cost of `layers` of the `total` layers of a chunk: that share of a whole
    step of it alone (its weight read included)."""
    assert times.decode_step_s is not None
    return layers / total * (times.decode_step_s + times.prompt_seconds(tokens, start))


def plan_slice(
    times: StepTimes,
    request: Request,
    allowance: float,
    most: int,
    total: int,
    reference: float,
) -> tuple[int, int] | None:
    """(tokens, layers) for `request`'s step within `allowance` seconds of long prompt work:
    the chunk it has in flight and as many of its next layers as fit (0 when not one does); or
    a new chunk of at most `most` tokens, sized so one layer of it fits the larger of the
    allowance and `reference` (the typical bounded step), with its first layer if that fits (a
    chunk in flight goes by its measured layer time, once it has one). None where
    a plain chunk does as well: its whole share fits the allowance, or the chunk a layer of
    which fits is no larger than the plain chunk that does."""
    start = request.num_computed_tokens
    if request.slice_layers:
        tokens = request.slice_tokens
        per_layer = request.slice_layer_s or slice_seconds(times, tokens, start, 1, total)
        return tokens, min(int(allowance / per_layer), total - request.slice_layers)
    plain = times.tokens_within(allowance, start, most)
    if plain >= most:
        return None
    assert times.decode_step_s is not None
    room = total * max(allowance, reference) - times.decode_step_s
    tokens = times.tokens_within(room, start, most)
    if tokens <= plain:
        return None
    # One layer first, whatever the model predicts: the slices that follow go by what it took
    # (`Request.slice_layer_s`), so a model fitted on other positions cannot stretch a step.
    return tokens, int(slice_seconds(times, tokens, start, 1, total) <= allowance)
