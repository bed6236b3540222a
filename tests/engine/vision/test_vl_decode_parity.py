"""Decode after images against transformers, step by step (issue 62, case 3): a prompt with an
off-square image (3x4 vision tokens) and a second image of another grid (5x2), so M-RoPE's
text positions after them run 12 behind the tokens' indices; then 16 greedy tokens equal to
transformers', each step's log-probability and every teacher-forced step's logits within 1e-3,
at prefill chunks of 16 and 32 tokens (block size 16: chunks that the images cut short), cold
and through the prefix cache (the same prompt twice).

The decode steps run as on a GPU, through the decode graphs' static buffers (`capture=False`)
and the Triton paged-attention kernel (interpreted on CPU): the graphs once gave the kernel the
rows' rotary positions as the positions it masks keys by, so after an image every decode query
missed its last keys (its own included) and the second token went wrong. The eager CPU path
(the PyTorch twin, the native decode step) is checked alike, and Qwen3.5's hybrid (Gated
DeltaNet beside gated attention) through the graphs too."""

from __future__ import annotations

# First: sets TRITON_INTERPRET before anything imports triton.
from tests.kernels.triton_interpret import IN_PROCESS, needs_interpreter, run_in_a_fresh_interpreter

# isort: split
from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.backends.triton_paged import TritonPagedAttention
from dgpp.engine.evaluation.teacher_force import teacher_forced_logits
from dgpp.engine.scheduling.request import PromptIds
from tests.conftest import tiny_model
from tests.engine.vision.vl_helpers import (
    QWEN3_VL,
    hf_vl_greedy,
    hf_vl_logits,
    vl_prompt,
)

NEW = 16
TOLERANCE = 1e-3
CPU = torch.device("cpu")
FAMILIES = {
    "qwen3-vl": ("Qwen3VLForConditionalGeneration", QWEN3_VL),
    "qwen3.5": ("Qwen3_5ForConditionalGeneration", {}),
}
# (family, decode path, prefill chunk tokens): one engine each
CASES = [
    ("qwen3-vl", "graphs", 16),
    ("qwen3-vl", "graphs", 32),
    ("qwen3-vl", "eager", 16),
    ("qwen3.5", "graphs", 16),
]


def _prompt(family: str) -> PromptIds:
    """38 tokens: text, a 3x4 image, text, a 5x2 image, text; positions after the images run
    12 behind the indices. Qwen3-VL's images sit where chunks of 16 and 32 would cut them
    (tokens 6 .. 18 and 24 .. 34); the hybrid's end before its snapshot points 16 and 32 (a
    prefix hit reaches as deep as a snapshot of the recurrent state)."""
    if family == "qwen3.5":
        parts = [
            [5],
            ((1, 6, 8), 1),
            [11, 12, 13, 14, 15],
            ((1, 10, 4), 2),
            [16, 17, 18, 19, 20, 21],
        ]
        prompt = vl_prompt(parts)
        return PromptIds(prompt, cache_hints=(16, 32), images=prompt.images)
    return vl_prompt(
        [[5, 6, 7, 8, 9], ((1, 6, 8), 1), [11, 12, 13, 14], ((1, 10, 4), 2), [15, 16, 17]]
    )


class _Reference:
    """A family's checkpoint and transformers' greedy tokens and logits for the prompt."""

    def __init__(self, checkpoint: Path, model: torch.nn.Module, family: str) -> None:
        self.checkpoint = checkpoint
        self.prompt = _prompt(family)
        self.tokens = hf_vl_greedy(model, self.prompt, NEW)
        self.logits = hf_vl_logits(model, self.prompt, self.tokens)  # [S, V]
        steps = self.logits[len(self.prompt) - 1 : len(self.prompt) - 1 + NEW]
        chosen = torch.tensor(self.tokens)[:, None]
        self.logprobs = steps.log_softmax(-1).gather(1, chosen)[:, 0].tolist()


@pytest.fixture(scope="module")
def references() -> dict[str, _Reference]:
    """Each family's reference, built by its first case."""
    return {}


def _reference(
    family: str, references: dict[str, _Reference], tmp: pytest.TempPathFactory, tokenizer: Path
) -> _Reference:
    if family not in references:
        architecture, overrides = FAMILIES[family]
        out = tmp.mktemp(family)
        model = tiny_model(architecture, **overrides)
        model.save_pretrained(str(out), safe_serialization=True)
        for item in tokenizer.iterdir():
            (out / item.name).write_bytes(item.read_bytes())
        references[family] = _Reference(out, model, family)
    return references[family]


def _engine(reference: _Reference, path: str, chunk: int) -> LLM:
    knobs = dict(block_size=16, prefill_chunk_tokens=chunk, kv_capacity=1024, max_model_len=64)
    if path == "eager":
        return LLM(str(reference.checkpoint), prefix_min_tokens=8, **knobs)
    with pytest.MonkeyPatch.context() as patch:  # the GPU's decode path: Triton, graphs
        patch.setattr(
            "dgpp.engine.execution.model_loading.select_backend_for",
            lambda *_: TritonPagedAttention(CPU),
        )
        llm = LLM(str(reference.checkpoint), prefix_min_tokens=8, **knobs)
    runner = llm.engine.runner
    assert runner.backends[0].name == "triton-paged"
    scratch = runner.config.num_kv_blocks - 1  # the pool's last block: never reached here
    slot = runner.state_layout.num_slots - 1  # hybrids: a snapshot slot no request takes here
    runner.attach_decode_graphs(1, scratch, capture=False, scratch_slot=slot)
    return llm


def _greedy_with_logprobs(llm: LLM, prompt: PromptIds) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    output = llm.generate([prompt], params)[0].outputs[0]
    return list(output.token_ids), [entry.logprob for entry in output.logprobs]


@needs_interpreter
@pytest.mark.parametrize(("family", "path", "chunk"), CASES, ids=lambda v: str(v))
def test_decode_after_images_matches_transformers_step_by_step(
    references: dict[str, _Reference],
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path,
    family: str,
    path: str,
    chunk: int,
) -> None:
    reference = _reference(family, references, tmp_path_factory, tokenizer_dir)
    prompt = reference.prompt
    assert len(prompt) > chunk and len(set(reference.tokens)) > 4  # distinct: a live model
    llm = _engine(reference, path, chunk)
    engine = llm.engine
    graphs = engine.runner.graphs

    # Teacher-forced: transformers' tokens through the engine, every step's logits compared
    # (once a family: the Triton interpreter is slow).
    if chunk == 16:
        forced = list(teacher_forced_logits(engine, prompt, reference.tokens))
        sampled = [position for position, _ in forced]
        assert sampled == list(range(len(prompt) - 1, len(prompt) + NEW))
        vocab = reference.logits.shape[-1]
        worst = [(out[:vocab] - reference.logits[at]).abs().max().item() for at, out in forced]
        assert max(worst) < TOLERANCE, [round(w, 4) for w in worst]

    # Greedy, cold and then on the prefix cache's blocks (images' blocks keyed by their pixels).
    hits = engine.counters.prefix_cache.hit_tokens
    for turn in ("cold", "cached"):
        tokens, logprobs = _greedy_with_logprobs(llm, prompt)
        assert tokens == reference.tokens, turn
        gaps = [abs(a - b) for a, b in zip(logprobs, reference.logprobs, strict=True)]
        assert max(gaps) < TOLERANCE, (turn, [round(g, 4) for g in gaps])
    assert engine.counters.prefix_cache.hit_tokens - hits >= 32  # two blocks, both images'
    if path == "graphs":
        assert graphs is not None and graphs.replays >= 2 * NEW - 2  # every decode step
    else:
        assert graphs is None
    assert engine.block_manager.num_used_blocks == 0


if not IN_PROCESS:

    def test_in_a_fresh_interpreter() -> None:
        run_in_a_fresh_interpreter(__file__)
