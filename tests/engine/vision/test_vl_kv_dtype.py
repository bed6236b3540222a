"""Images before decode at a quantized KV cache (issue 65): Qwen3-VL's prompt of an off-square
image and a second of another grid, in prefill chunks of 16 and 8 that the images cut short,
then 16 decode steps. At int8 and fp8 every decode step's log-probabilities stay within the
family bounds of the model-dtype cache (tests/engine/test_kv_cache_dtype.py's), a top token
changes only at a near tie, both chunk sizes read the same rows, the pools are quantized, and
a second run of the same prompt hits the images' quantized blocks in the prefix cache and
gives the cold run's tokens and log-probabilities exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.evaluation.teacher_force import teacher_forced_logits
from dgpp.engine.scheduling.request import PromptIds
from tests.conftest import tiny_model
from tests.engine.vision.vl_helpers import QWEN3_VL, vl_prompt

NEW = 16
BOUND = {"int8": 0.08, "fp8_e4m3": 0.25}  # mean over steps of the worst |Δ logprob|


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("qwen3-vl")
    model = tiny_model("Qwen3VLForConditionalGeneration", **QWEN3_VL)
    model.save_pretrained(str(out), safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        (out / item.name).write_bytes(item.read_bytes())
    return out


def _engine(checkpoint: Path, kv: str, chunk: int) -> LLM:
    return LLM(
        str(checkpoint), dtype="float32", block_size=16, prefill_chunk_tokens=chunk,
        kv_capacity=1024, max_model_len=64, prefix_min_tokens=8, kv_cache_dtype=kv,
    )  # fmt: skip


def _prompt() -> PromptIds:
    """Text, a 3x4 image, text, a 5x2 image, text (tokens 6 .. 18 and 24 .. 34)."""
    return vl_prompt(
        [[5, 6, 7, 8, 9], ((1, 6, 8), 1), [11, 12, 13, 14], ((1, 10, 4), 2), [15, 16, 17]]
    )


def _forced(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """Log-probabilities [NEW + 1, V] at the prompt's last position and each forced step."""
    rows = [logits for _, logits in teacher_forced_logits(llm.engine, _prompt(), tokens)]
    return torch.stack(rows).log_softmax(-1)


@pytest.mark.parametrize("kv", list(BOUND))
def test_decode_after_images_at_a_quantized_cache(checkpoint: Path, kv: str) -> None:
    prompt = _prompt()
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    plain = _engine(checkpoint, "auto", 16)
    tokens = list(plain.generate([prompt], params)[0].outputs[0].token_ids)
    assert len(set(tokens)) > 4, "a live model"
    want = _forced(plain, tokens)
    forced: dict[int, torch.Tensor] = {}
    for chunk in (16, 8):
        llm = _engine(checkpoint, kv, chunk)
        assert any(pool.dtype == torch.uint8 for pool in llm.engine.runner.kv_caches)
        engine = llm.engine
        cold = llm.generate([prompt], params)[0].outputs[0]  # the images' blocks cached
        got = _forced(llm, tokens)
        worst = (got - want).abs().amax(dim=-1)
        assert 0 < float(worst.mean()) < BOUND[kv], (chunk, worst.tolist())
        # The top token may change only where the reference's top two are closer than the
        # perturbation moves them (a near tie of a random tiny model), nowhere else.
        top2 = want.topk(2, dim=-1).values
        flipped = got.argmax(-1) != want.argmax(-1)
        near_tie = (top2[:, 0] - top2[:, 1]) < 2 * worst
        assert bool((near_tie | ~flipped).all()), (chunk, flipped.tolist(), near_tie.tolist())
        forced[chunk] = got
        hits = engine.counters.prefix_cache.hit_tokens
        cached = llm.generate([prompt], params)[0].outputs[0]
        assert engine.counters.prefix_cache.hit_tokens - hits >= 32  # both images' blocks
        assert list(cached.token_ids) == list(cold.token_ids), chunk
        assert [e.logprob for e in cached.logprobs] == [e.logprob for e in cold.logprobs]
        assert engine.block_manager.num_used_blocks == 0
    # Every row is stored before it is read, so a chunk reads the same rows as a whole prompt.
    assert torch.allclose(forced[16], forced[8], atol=1e-5)
