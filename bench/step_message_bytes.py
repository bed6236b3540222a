"""Bytes rank 0 sends every other rank per decode step, in a real world of two ranks (gloo, two
processes), at several context lengths: the compact step message beside the pickled step
tensors dgpp sent before (rebuilt here from the same steps: the same metadata tensors the PyTorch
backend builds, pickled as `broadcast_object_list` pickles them).

    python bench/step_message_bytes.py [--contexts 512,4096,32768] [--requests 4]

Models: the default model (SmolLM2-135M, contexts up to its 8,192 positions) and a tiny
random-weight Llama with 65,536 positions and the default model's tokenizer, built here. The
requests of one run share a prompt but its last token, so one prefill serves all of them (the
prefix cache); every request then decodes `--max-tokens` tokens. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from dgpp.engine import SamplingParams
from dgpp.engine.backends.base import BatchLayout, BatchRow
from dgpp.engine.backends.torch_paged import TorchPagedAttention
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.distributed.control import Command, ControlChannel
from dgpp.engine.execution.step_message import BlockTables, StepMessage
from dgpp.engine.planning.resolved import resolve

TIMEOUTS = {"rendezvous_s": 120, "control_deadline_s": 600}


class MeasuringChannel:
    """Rank 0's control channel, recording per step what it sent and what the pickled step
    tensors of the same step would have been."""

    def __init__(self, inner: ControlChannel, block_size: int) -> None:
        self.inner = inner
        self.block_size = block_size
        self.tables = BlockTables()
        self.backend = TorchPagedAttention(torch.device("cpu"))
        self.decode_steps: list[tuple[int, int]] = []  # (sent bytes, pickled-tensors bytes)

    def send(self, command: Command, message: StepMessage | None = None) -> None:
        before = self.inner.num_bytes_sent
        self.inner.send(command, message)
        if message is None:
            return
        self.tables.apply(message)
        if not message.has_prefill:
            sent = self.inner.num_bytes_sent - before
            self.decode_steps.append((sent, self._pickled_tensors(message)))

    def _pickled_tensors(self, message: StepMessage) -> int:
        layout = BatchLayout(
            tuple(BatchRow(r.start, r.num_tokens, self.tables[r.seq_id]) for r in message.rows),
            message.num_decodes,
            self.block_size,
            prefill_softmax_fp32=True,
        )
        ids = torch.tensor([t for r in message.rows for t in r.token_ids])
        positions = torch.tensor([p for r in message.rows for p in range(r.start, r.seq_len)])
        sample_index = torch.arange(len(message.rows))
        inputs = ("step", (ids, positions, self.backend.prepare(layout), sample_index, False))
        return len(pickle.dumps([inputs]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(port: int) -> None:
    import os

    import torch.distributed as dist

    from dgpp.engine.distributed.worker import Worker
    from dgpp.engine.distributed.world_spec import WorldSpec, WorldTimeouts

    worker = Worker(WorldSpec(rank=1, port=port, timeouts=WorldTimeouts(**TIMEOUTS)))
    threading.Thread(target=worker.run, args=(threading.Event(),), daemon=True).start()
    while not worker.generations or dist.is_initialized():
        time.sleep(0.05)
    os._exit(0)


def measure(checkpoint: Path, context: int, args: argparse.Namespace) -> dict[str, Any]:
    from dgpp.engine.distributed.world_spec import WorldSpec, WorldTimeouts
    from dgpp.engine.head import Head

    block_size = 16
    config = EngineConfig(
        model=str(checkpoint),
        kv_capacity=(args.requests + 1) * (context + 64),
        max_model_len=context + 32,
        block_size=block_size,
        prefill_chunk_tokens=2048,
        prefix_min_tokens=0,
        resident_cache=False,
        num_threads=1,
    )
    port = _free_port()
    worker = mp.get_context("spawn").Process(target=_worker, args=(port,))
    worker.start()
    spec = WorldSpec(rank=0, port=port, world_size=2, timeouts=WorldTimeouts(**TIMEOUTS))
    head = Head(resolve(config, checkpoint, spec.world_size), spec)
    try:
        engine = head.form()
        assert engine.control is not None
        channel = MeasuringChannel(engine.control, block_size)
        engine.control = channel  # type: ignore[assignment]
        base = [(7 * i) % 40000 + 100 for i in range(context - 1)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for index in range(args.requests):
            engine.add_request([*base, 200 + index], params)
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - started
    finally:
        head.dissolve(orderly=True)
        worker.join(timeout=60)
    sent = [step[0] for step in channel.decode_steps]
    pickled = [step[1] for step in channel.decode_steps]
    return {
        "context": context,
        "decode_steps": len(sent),
        "sent_mean": statistics.mean(sent),
        "sent_max": max(sent),
        "pickled_mean": statistics.mean(pickled),
        "seconds": seconds,
    }


def tiny_long_context_checkpoint(out: Path) -> Path:
    """A random-weight Llama of 65,536 positions with the default model's tokenizer."""
    import transformers

    from dgpp.appliance.models.default import install_default

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(install_default()))
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65536,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    contexts = [int(value) for value in args.contexts.split(",")]
    from dgpp.appliance.models.default import install_default

    with tempfile.TemporaryDirectory() as scratch:
        models = {
            "SmolLM2-135M (default)": (install_default(), 8192),
            "tiny Llama, 64K positions": (tiny_long_context_checkpoint(Path(scratch)), 65536),
        }
        print(
            f"| model | context | decode steps | bytes/step sent | max | pickled tensors "
            f"(before) | ratio |  # {args.requests} requests, world 2"
        )
        print("|---|---|---|---|---|---|---|")
        for name, (checkpoint, limit) in models.items():
            for context in contexts:
                if context + 32 > limit:
                    continue
                row = measure(checkpoint, context, args)
                ratio = row["pickled_mean"] / row["sent_mean"]
                print(
                    f"| {name} | {context} | {row['decode_steps']} | {row['sent_mean']:.0f} | "
                    f"{row['sent_max']} | {row['pickled_mean']:.0f} | {ratio:.0f}x |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
