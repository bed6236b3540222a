"""Helpers that compare dgpp with transformers on the same checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dgpp.engine import LLM
from dgpp.engine.evaluation.teacher_force import teacher_forced_logits


@contextmanager
def earliest_ties(seen: list[bool] | None = None) -> Iterator[None]:
    """transformers' top-k choices with the keys tied at the cut taken earliest first, as
    dgpp's sparse indexers take them (`dgpp.kernels.topk_ties`): `Tensor.topk` as a stable
    descending sort. Left to the CPU's `torch.topk`, transformers picks among tied indexer
    scores by the row's length, so it disagrees with itself (its forward over a prompt's first
    100 tokens and over all 200 differed on those 100 by up to 2.3 in logprob; issue 62).
    `seen` records, per call, whether a cut fell among tied finite scores. Elsewhere (routers)
    it changes nothing: without ties a stable sort's first k are topk's."""
    original = torch.Tensor.topk

    def stable(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, **_: Any) -> Any:
        values, indices = torch.sort(self + 0.0, dim=dim, descending=largest, stable=True)
        if seen is not None and self.shape[dim] > k > 0:
            cut, after = values.select(dim, k - 1), values.select(dim, k)
            seen.append(bool(((cut == after) & cut.isfinite()).any()))
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = stable  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]


def hf_token_logprobs(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' log-probability of each token after the first [len - 1], one forward, its
    sparse indexers' ties taken earliest first (`earliest_ties`)."""
    with torch.inference_mode(), earliest_ties():
        logits = hf_model(torch.tensor([tokens])).logits[0].float()
    picked = torch.tensor(tokens[1:])[:, None]
    return logits[:-1].log_softmax(-1).gather(1, picked)[:, 0]


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy decoding (argmax with its KV cache, as `generate` does), running past
    EOS like dgpp's `ignore_eos`; `generate` itself cannot ignore EOS without masking its logits."""
    tokens: list[int] = []
    past = None
    step_ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            result = hf_model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            tokens.append(token)
            step_ids = torch.tensor([[token]])
    return tokens


def max_logit_difference(
    llm: LLM, hf_model: torch.nn.Module, prompt: list[int], continuation: list[int]
) -> float:
    """Teacher-force `prompt + continuation` through dgpp (`teacher_forced_logits`: prompt in
    prefill chunks, then one decode row per token, all through the paged cache) and return the
    largest absolute difference from transformers' logits at every position dgpp samples from."""
    with torch.inference_mode():
        reference = hf_model(torch.tensor([prompt + continuation])).logits[0].float()  # [S, V]
    vocab = reference.shape[-1]
    worst = 0.0
    for position, logits in teacher_forced_logits(llm.engine, prompt, continuation):
        worst = max(worst, (logits[:vocab] - reference[position]).abs().max().item())
    return worst


def engines_logit_difference(
    one: LLM, other: LLM, prompt: list[int], continuation: list[int]
) -> float:
    """The largest difference between two dgpp engines' logits at every position while
    `prompt + continuation` is teacher-forced through each (same weights, two paths)."""
    pairs = zip(
        teacher_forced_logits(one.engine, prompt, continuation),
        teacher_forced_logits(other.engine, prompt, continuation),
        strict=True,
    )
    worst = max((a[1] - b[1]).abs().max().item() for a, b in pairs)
    # the two generators interleaved: inference mode must not outlive them (it once did, and
    # a later test's host pool, made in it, refused in-place copies from a reader thread)
    assert not torch.is_inference_mode_enabled()
    return worst


def random_prompts(seed: int, lengths: tuple[int, ...] = (1, 5, 13, 40)) -> list[list[int]]:
    """Prompts of random token ids (the tiny checkpoints' vocabulary), one per length."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in lengths]


def check_batch_matches_transformers(
    llm: LLM, hf_model: torch.nn.Module, prompts: list[list[int]], new: int
) -> None:
    """The prompts in one batch give transformers' greedy tokens (of which more than 20
    distinct: a broken model repeats itself), and teacher-forced logits within 1e-3 of its
    (every prompt but the first, continued by 6 of transformers' tokens)."""
    from dgpp.engine import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    outputs = llm.generate(prompts, greedy)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, new)
    assert len({token for o in outputs for token in o.outputs[0].token_ids}) > 20
    worst = max(
        max_logit_difference(llm, hf_model, prompt, hf_greedy(hf_model, prompt, 6))
        for prompt in prompts[1:]
    )
    assert worst < 1e-3, worst


def check_snapshot_hits(
    checkpoint: object, hf_model: torch.nn.Module | None, **knobs: object
) -> None:
    """A hybrid model's prefix hits (its states restored from snapshots) give transformers'
    tokens (`hf_model`; None: an engine of the same `knobs` without the prefix cache): where
    prompts branch (the third prompt restores what the second saved: 28 tokens) and on a
    conversation's next turn (restored after the first prompt's 24 tokens)."""
    from dgpp.engine import SamplingParams

    shape = {"block_size": 4, "prefill_chunk_tokens": 16, **knobs}
    cached = LLM(str(checkpoint), prefix_min_tokens=8, **shape)
    cold = None if hf_model is not None else LLM(str(checkpoint), prefix_cache=False, **shape)
    counters = cached.engine.counters.prefix_cache
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(prompt: list[int]) -> list[int]:
        got = list(cached.generate([prompt], greedy)[0].outputs[0].token_ids)
        if cold is not None:
            assert got == list(cold.generate([prompt], greedy)[0].outputs[0].token_ids)
        else:
            assert got == hf_greedy(hf_model, prompt, 8)
        return got

    shared = list(range(500, 530))
    for suffix in ([7, 8, 9], [11, 12], [13, 14, 15]):
        run(shared + suffix)
    assert counters.hit_tokens == 28
    first = list(range(900, 927))
    reply = run(first)
    run(first + reply + [40, 41])
    assert counters.hit_tokens == 28 + 24
