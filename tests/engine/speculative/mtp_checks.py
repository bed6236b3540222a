"""Checks the speculative tests of every family share: one step of a checkpoint's MTP layer,
built and loaded beside its target; the memory plan's account of the layer; and oracle drafts
(the plain run's next tokens, all right or one wrong at a varying depth)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dgpp.engine import LLM
from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.cache_spec import allocate_caches, cache_layers
from dgpp.engine.checkpoint.loader import load_weights
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.execution.step_message import StepMessage
from dgpp.engine.models.mtp import MtpLayer
from dgpp.engine.planning.memory_plan import DeviceMemory, MemoryPlan, plan_memory


@dataclass(frozen=True)
class MtpStep:
    """The layer's output g [T, H] and logits [T, vocab] for random target hidden states h
    [T, H] and next tokens over positions 0 .. T - 1, with the target it was built beside."""

    target: torch.nn.Module
    layer: MtpLayer
    h: torch.Tensor
    next_ids: torch.Tensor
    g: torch.Tensor
    logits: torch.Tensor


def mtp_step(checkpoint: Path, config: Any, tokens: int = 21) -> MtpStep:
    """Build the MTP layer beside the checkpoint's target, load it (every parameter, or the
    loader raises) and run one causal prefill of `tokens` positions through it."""
    llm = LLM(str(checkpoint), kv_capacity=256, block_size=16)  # the target skips the layer
    runner = llm.engine.runner
    target, backend = runner.model, runner.backends[0]
    layer = MtpLayer(target, ParallelContext(), backend, config.num_hidden_layers)
    load_weights(layer, checkpoint)
    allocate_caches(cache_layers(layer), 4, 16, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(tokens, config.hidden_size, generator=gen)
    next_ids = torch.randint(3, 1000, (tokens,), generator=gen)
    layout = BatchLayout((BatchRow(0, tokens, [2, 0]),), 0, 16, prefill_softmax_fp32=True)
    with torch.inference_mode():
        g = layer(h, next_ids, torch.arange(tokens), {backend.name: backend.prepare(layout)})
        logits = layer.compute_logits(g)[:, : config.vocab_size]
    return MtpStep(target, layer, h, next_ids, g, logits)


def check_mtp_memory_plan(checkpoint: Path, **knobs: Any) -> tuple[LLM, MemoryPlan, MemoryPlan]:
    """`speculative: mtp`'s plan holds the MTP layer's KV pool and its weights byte for byte
    beside the plan without it; the engine and both plans, for further checks."""
    llm = LLM(str(checkpoint), speculative="mtp", **knobs)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.mtp is not None
    plenty = DeviceMemory(64 << 30, 48 << 30, "test host", is_accelerator=False)
    plan = plan_memory(engine.config, engine.model_config, 1, plenty)
    assert plan.kv_bytes == sum(pool.nbytes for pool in [*runner.kv_caches, *runner.mtp.caches])
    plain = plan_memory(replace(engine.config, speculative="off"), engine.model_config, 1, plenty)
    mtp_bytes = sum(p.numel() * p.element_size() for p in runner.mtp.layer.parameters())
    assert plan.weights_bytes - plain.weights_bytes == mtp_bytes
    assert plan.kv_bytes - plain.kv_bytes == sum(pool.nbytes for pool in runner.mtp.caches)
    return llm, plan, plain


def partly_right(sequence: list[int], start: int, count: int, wrong: int) -> tuple[int, ...]:
    """`count` tokens of `sequence` from `start`, the one at depth `wrong` (if there is one)
    made wrong: drawn with a depth that varies with the position, every accepted count occurs."""
    draft = list(sequence[start : start + count])
    if wrong < len(draft):
        draft[wrong] += 1
    return tuple(draft)


def oracle_draft_pass(
    monkeypatch: Any, engine: Any, full: dict[tuple[int, ...], list[int]], wrong: bool = False
) -> None:
    """Replace the MTP draft pass's tokens by the plain run's next ones (`full`: each prompt's
    whole plain sequence), all right or, with `wrong`, one wrong at depth `seq_len % 5`; the
    layer's own pass still runs (its cache, the chain)."""
    run = engine.runner.draft

    def oracle(message: StepMessage) -> list[tuple[int, ...]]:
        made = run(message)
        by_seq = {r.seq_id: r for r in engine.scheduler.requests.values()}
        drafts = []
        for row, own in zip(message.rows, made, strict=True):
            assert len(own) == row.num_sampled
            sequence = full[tuple(by_seq[row.seq_id].prompt_token_ids)]
            depth = row.seq_len % 5 if wrong else row.num_sampled
            drafts.append(partly_right(sequence, row.seq_len + 1, row.num_sampled, depth))
        return drafts

    monkeypatch.setattr(engine.runner, "draft", oracle)
