"""A world of two real ranks (two processes over gloo) agrees on its kernels: rank 1's
self-check fails RMSNorm (an injected error), and rank 0, whose own check passed, serves the
twin too and says so in its stats; both serve the same tokens as a world of one. Rank 0's
stats carry the world's all-reduce bandwidth, measured at warm-up."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from dgpp.engine import SamplingParams
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.engine import LLMEngine
from dgpp.engine.planning.resolved import resolve
from tests.conftest import build_tiny_checkpoint
from tests.engine.distributed.test_tensor_parallel import _free_port

KNOBS = {"kv_capacity": 256, "block_size": 4, "num_threads": 1, "dtype": "float32"}
PROMPT = list(range(300, 320))


def _tokens(engine: LLMEngine) -> list[int]:
    request = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    return list(request.output_token_ids)


def _wrong(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return 2 * x


def _rank(rank: int, port: int, checkpoint: str, results: Any, cache: str) -> None:
    os.environ.update(DGPP_SELFCHECK="force", XDG_CACHE_HOME=f"{cache}/rank{rank}")
    from dgpp.engine.distributed.world_spec import WorldSpec, WorldTimeouts

    timeouts = WorldTimeouts(rendezvous_s=60, control_deadline_s=60)
    if rank > 0:
        import torch.distributed as dist

        from dgpp.engine.distributed.worker import Worker
        from dgpp.kernels import rms_norm_triton

        rms_norm_triton.rms_norm_triton = _wrong  # this rank's GPU "miscompiles" RMSNorm
        worker = Worker(WorldSpec(rank=rank, port=port, timeouts=timeouts))
        threading.Thread(target=worker.run, args=(threading.Event(),), daemon=True).start()
        while not worker.generations or dist.is_initialized():
            time.sleep(0.05)
        os._exit(0)
    from dgpp.engine.head import Head

    config = EngineConfig(model=checkpoint, **KNOBS)
    spec = WorldSpec(rank=0, port=port, world_size=2, timeouts=timeouts)
    head = Head(resolve(config, Path(checkpoint), spec.world_size), spec)
    try:
        engine = head.form()
        stats = engine.stats()
        results.put((stats.kernels, stats.allreduce, _tokens(engine)))
    finally:
        head.dissolve(orderly=True)


def test_ranks_agree_on_a_kernel_one_rank_switched_off(tmp_path: Path, tokenizer_dir: Path) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt", tokenizer_dir, "LlamaForCausalLM")
    expected = _tokens(LLMEngine(resolve(EngineConfig(model=str(checkpoint), **KNOBS), checkpoint)))
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    args = (port, str(checkpoint), results, str(tmp_path / "cache"))
    ranks = [context.Process(target=_rank, args=(rank, *args)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        kernels, allreduce, tokens = results.get(timeout=240)
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert kernels["rms_norm"] == "fallback: switched off on 1 of 2 ranks", kernels
    assert kernels["paged_attention"] == "ok"
    assert tokens == expected
    # The world's all-reduce, measured at its warm-up (gloo over loopback here).
    assert [each["bytes"] for each in allreduce] == [64 << 10, 1 << 20, 4 << 20]
    assert all(each["bus_gbps"] > 0 and each["seconds"] > 0 for each in allreduce)
