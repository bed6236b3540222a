"""The authenticated rendezvous: proofs over the cluster secret, a process without the secret
refused while a world forms and while it serves, and handshake data that is never unpickled
(real processes over gloo on loopback)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from pathlib import Path
from typing import Any

from dgpp.engine.distributed.cluster_secret import NO_PROOF, prove, verify
from tests.engine.distributed.test_tensor_parallel import _free_port, _generate

SECRET = b"s" * 32
WRONG = b"w" * 32
KNOBS = {"kv_capacity": 1024, "block_size": 4, "prefill_chunk_tokens": 16, "num_threads": 1}


def test_a_proof_is_bound_to_its_secret_role_generation_and_rank() -> None:
    proof = prove(SECRET, "seat", 3, 1, "challenge", "host:1")
    assert verify(SECRET, proof, "seat", 3, 1, "challenge", "host:1")
    for parts in (
        ("seat", 4, 1, "challenge", "host:1"),  # another generation
        ("seat", 3, 2, "challenge", "host:1"),  # another rank
        ("world", 3, 1, "challenge", "host:1"),  # another role
        ("seat", 3, 1, "other", "host:1"),  # another challenge
    ):
        assert not verify(SECRET, proof, *parts)
    assert not verify(WRONG, proof, "seat", 3, 1, "challenge", "host:1")
    assert not verify(SECRET, NO_PROOF, "seat", 3, 1, "challenge", "host:1")
    assert not verify(SECRET, 42, "seat")  # not even a string
    assert verify(None, NO_PROOF, "seat") and prove(None, "seat") == NO_PROOF  # an open world


def _timeouts() -> Any:
    from dgpp.engine.distributed.world_spec import WorldTimeouts

    return WorldTimeouts(rendezvous_s=60, control_deadline_s=60)


def _head(port: int, checkpoint: str, results: Any, rogue_done: Any) -> None:
    """Rank 0: form the world (with the secret), generate, then, while the world still
    serves, wait for a second rogue attempt and generate again."""
    from dgpp.engine.configuration.engine_config import EngineConfig
    from dgpp.engine.distributed.world_spec import WorldSpec
    from dgpp.engine.head import Head
    from dgpp.engine.planning.resolved import resolve

    spec = WorldSpec(rank=0, port=port, world_size=2, timeouts=_timeouts(), secret=SECRET)
    head = Head(resolve(EngineConfig(model=checkpoint, **KNOBS), Path(checkpoint), 2), spec)
    try:
        engine = head.form()
        first = _generate(engine)
        rogue_done.wait(120)
        results.put(("head", first, _generate(engine)))
    finally:
        head.dissolve(orderly=True)


def _worker(port: int, secret: bytes) -> None:
    import threading

    import torch.distributed as dist

    from dgpp.engine.distributed.worker import Worker
    from dgpp.engine.distributed.world_spec import WorldSpec

    worker = Worker(WorldSpec(rank=1, port=port, timeouts=_timeouts(), secret=secret))
    threading.Thread(target=worker.run, args=(threading.Event(),), daemon=True).start()
    while not worker.generations or dist.is_initialized():
        time.sleep(0.05)
    os._exit(0)


def _rogue(port: int, results: Any, tag: str) -> None:
    """A process with the wrong secret trying to join as rank 1."""
    from dgpp.engine.distributed.world import WorldSpec, join_world

    try:
        join_world(WorldSpec(rank=1, port=port, timeouts=_timeouts(), secret=WRONG))
        results.put((tag, "joined"))
    except Exception as err:
        results.put((tag, f"{type(err).__name__}: {err}"))


def test_a_process_without_the_secret_is_refused_and_the_world_is_unaffected(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    from tests.conftest import build_tiny_checkpoint

    checkpoint = str(build_tiny_checkpoint(tmp_path, tokenizer_dir, "Qwen2ForCausalLM"))
    from dgpp.engine.configuration.engine_config import EngineConfig
    from dgpp.engine.engine import LLMEngine
    from dgpp.engine.planning.resolved import resolve

    expected = _generate(
        LLMEngine(resolve(EngineConfig(model=checkpoint, **KNOBS), Path(checkpoint)))
    )
    context = mp.get_context("spawn")
    results, rogue_done = context.Queue(), context.Event()
    port = _free_port()
    head = context.Process(target=_head, args=(port, checkpoint, results, rogue_done))
    head.start()
    processes = [head]
    try:
        # While the world forms: the rogue takes rank 1's seat first and is refused by name.
        rogue = context.Process(target=_rogue, args=(port, results, "forming"))
        rogue.start()
        processes.append(rogue)
        tag, outcome = results.get(timeout=120)
        assert tag == "forming"
        assert outcome.startswith("SecretMismatch: rank 0 at 127.0.0.1") and "refused" in outcome
        worker = context.Process(target=_worker, args=(port, SECRET))
        worker.start()
        processes.append(worker)
        # While it serves: the seat is held; the rogue gets nowhere and nothing changes.
        time.sleep(1.0)
        late = context.Process(target=_rogue, args=(port, results, "serving"))
        late.start()
        processes.append(late)
        tag, outcome = results.get(timeout=120)
        assert tag == "serving" and outcome != "serving: joined", outcome
        assert "joined" not in outcome
        rogue_done.set()
        tag, first, second = results.get(timeout=180)
        assert tag == "head"
        assert first == expected and second == expected
    finally:
        rogue_done.set()
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert head.exitcode == 0


def _pickling_peer(port: int, marker: str, rank: int, results: Any) -> None:
    """Rank 0 runs the real handshake; rank 1 answers with a pickle that would create
    `marker` if anyone unpickled it."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dgpp.engine.distributed.handshake import WorldConfig, push_config

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    try:
        if rank == 0:
            try:
                push_config(WorldConfig.of({"world_size": 2}), group)
                results.put("accepted")
            except Exception as err:
                results.put(f"{type(err).__name__}: {err}")
            time.sleep(2.0)  # let rank 1 finish its send before the store goes away
            return
        # The configuration arrives as JSON: receive it the way the protocol sends it.
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=group)
        dist.broadcast(torch.zeros(int(size[0]), dtype=torch.uint8), src=0, group=group)
        payload = pickle.dumps(_Exploit(marker))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(sizes, torch.tensor([data.numel()]), group=group)
        longest = max(int(s[0]) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        dist.all_gather([torch.zeros(longest, dtype=torch.uint8) for _ in range(2)], padded, group)
    finally:
        os._exit(0)  # no orderly teardown: rank 0 stopped listening after the bad answer


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


def test_a_pickled_answer_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [
        context.Process(target=_pickling_peer, args=(port, str(marker), rank, results))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        outcome = results.get(timeout=120)
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert outcome == "MalformedPeerData: rank 1 sent data that is not JSON", outcome
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(_Exploit(str(marker)))) is None and marker.exists()  # armed
