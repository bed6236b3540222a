"""Sections (b)-(d) of the GPU check, on random-weight checkpoints built in the run
(`gpu_check_build`): greedy parity with transformers, decode time against the weight-bytes /
bandwidth roofline, and prefill throughput with attention's share."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from gpu_check_build import DECODE_LLAMA, DRY_DECODE_LLAMA, TINY_LLAMA, TINY_MOE, random_checkpoint
from gpu_check_kernels import sync, timed_ms

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.evaluation.teacher_force import teacher_forced_logits
from dgpp.engine.execution.decode_graphs import DecodeGraphs

PROMPT = [0, 17, 42, 7, 99, 3, 150, 28]
CPU = torch.device("cpu")


def _hf(checkpoint: Path, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).to(device).eval()


def _hf_greedy(model: Any, prompt: list[int], new: int, device: torch.device) -> list[int]:
    tokens, past, ids = [], None, torch.tensor([prompt], device=device)
    with torch.inference_mode():
        for _ in range(new):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]], device=device)
    return tokens


def parity(device: torch.device, work: Path) -> list[dict[str, Any]]:
    """(b) on a tiny Llama and a tiny Qwen3-MoE (`model_parity`)."""
    return [
        model_parity(device, work, "tiny Llama", "LlamaForCausalLM", TINY_LLAMA),
        model_parity(device, work, "tiny Qwen3-MoE", "Qwen3MoeForCausalLM", TINY_MOE),
    ]


def model_parity(
    device: torch.device, work: Path, name: str, architecture: str, sizes: dict[str, Any]
) -> dict[str, Any]:
    """Float32 greedy tokens equal transformers'; bfloat16 top-1 agreement and the largest
    logit difference against transformers' own bfloat16 run, teacher-forced on its tokens."""
    checkpoint = random_checkpoint(work / name.replace(" ", "-"), architecture, sizes, device)
    hf = _hf(checkpoint, torch.float32, device)
    expected = _hf_greedy(hf, PROMPT, 24, device)
    del hf
    llm = LLM(str(checkpoint), device=device.type, dtype="float32", kv_capacity=512, block_size=16)
    got = _greedy(llm, [PROMPT], 24)[0]
    del llm
    hf16 = _hf(checkpoint, torch.bfloat16, device)
    continuation = _hf_greedy(hf16, PROMPT, 24, device)
    sequence = PROMPT + continuation
    with torch.inference_mode():
        logits = hf16(torch.tensor([sequence], device=device)).logits
        reference = logits[0, len(PROMPT) - 1 :].float()
    del hf16
    llm16 = LLM(
        str(checkpoint), device=device.type, dtype="bfloat16", kv_capacity=512, block_size=16
    )
    forced = teacher_forced_logits(llm16.engine, PROMPT, continuation)
    ours = torch.stack([logits for _, logits in forced])[: reference.shape[0]]
    vocab = reference.shape[-1]
    return {
        "model": name,
        "float32_greedy_equal": list(got) == expected,
        "bf16_top1_agreement": float(
            (ours[:, :vocab].argmax(-1) == reference.argmax(-1)).float().mean()
        ),
        "bf16_max_logit_diff": float((ours[:, :vocab] - reference).abs().max()),
    }


def copy_bandwidth_gbs(device: torch.device, dry_run: bool) -> float:
    size = (64 if dry_run else 2048) * 2**20
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = timed_ms(lambda: target.copy_(source), device, 5 if dry_run else 20)
    return 2 * size / (ms / 1e3) / 1e9  # read + write


def _greedy(llm: LLM, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def graphed_equals_eager(llm: LLM, graphs: DecodeGraphs) -> bool:
    """Greedy tokens of 5 prompts of different lengths (the batch shrinks as they finish, so
    several buckets and padded rows are used) through `graphs`, against the eager engine."""
    runner = llm.engine.runner
    prompts = [[(13 * i + j) % 200 + 2 for j in range(5 + 9 * i)] for i in range(5)]
    kept, runner.graphs = runner.graphs, None
    eager = _greedy(llm, prompts, 12)
    runner.graphs = graphs
    before = graphs.replays
    graphed = _greedy(llm, prompts, 12)
    runner.graphs = kept
    return graphed == eager and graphs.replays > before


def dry_run_graphs(work: Path) -> bool:
    """CPU stand-in for the capture: a tiny Llama on the (interpreted) Triton backend whose
    decode steps run through the graphs' static, padded buffers without capturing."""
    from dgpp.engine.backends.triton_paged import TritonPagedAttention
    from dgpp.engine.execution import model_loading

    checkpoint = random_checkpoint(work / "graphs-llama", "LlamaForCausalLM", TINY_LLAMA, CPU)
    chosen = model_loading.select_backend_for
    model_loading.select_backend_for = lambda *_: TritonPagedAttention(CPU)
    try:
        llm = LLM(str(checkpoint), kv_capacity=1024, block_size=16)
    finally:
        model_loading.select_backend_for = chosen
    scratch = llm.engine.config.num_kv_blocks - 1  # never reached by these prompts
    graphs = llm.engine.runner.attach_decode_graphs(8, scratch, capture=False)
    llm.engine.runner.graphs = None
    return graphed_equals_eager(llm, graphs)


def decode_and_prefill(device: torch.device, work: Path, dry_run: bool) -> dict[str, Any]:
    """(c) decode ms/token at batch 1 and 16, eager and graphed, against weight bytes / copy
    bandwidth, and graphed greedy tokens against eager; (d) prefill tok/s of one long prompt
    (4K and 32K; short ones under `--dry-run`)."""
    sizes = DRY_DECODE_LLAMA if dry_run else DECODE_LLAMA
    checkpoint = random_checkpoint(work / "decode-llama", "LlamaForCausalLM", sizes, device)
    lengths = (256, 1024) if dry_run else (4096, 32768)
    llm = LLM(
        str(checkpoint), device=device.type, kv_capacity=max(lengths) + 16 * 160 + 64,
        block_size=16, max_model_len=max(lengths) + 64, cuda_graph_max_batch=16,
    )  # fmt: skip
    engine = llm.engine
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    bandwidth = copy_bandwidth_gbs(device, dry_run)
    out: dict[str, Any] = {"weight_GB": weight_bytes / 1e9, "copy_GBps": bandwidth}
    out["roofline_ms"] = weight_bytes / (bandwidth * 1e9) * 1e3
    started = time.perf_counter()
    engine.warm_up()  # captures the decode graphs (CUDA)
    out["warm_up_s"] = time.perf_counter() - started
    graphs = engine.runner.graphs
    if graphs is None:
        out["graphed_equals_eager"] = dry_run_graphs(work) if dry_run else False
    else:
        out["graphed_equals_eager"] = graphed_equals_eager(llm, graphs)
    for chosen in (None, graphs) if graphs is not None else (None,):
        engine.runner.graphs = chosen
        for batch in (1, 16):
            prompts = [[(7 * i + j) % 200 + 2 for j in range(16)] for i in range(batch)]

            def run(new: int, prompts: list[list[int]] = prompts) -> float:
                sync(device)
                start = time.perf_counter()
                _greedy(llm, prompts, new)
                sync(device)
                return time.perf_counter() - start

            short, long = (4, 12) if dry_run else (16, 144)
            run(short)  # warm-up
            per_step = (run(long) - run(short)) / (long - short)
            suffix = "" if chosen is None else "_graphed"
            out[f"decode_ms_b{batch}{suffix}"] = per_step * 1e3
    engine.runner.graphs = graphs
    for length in lengths:
        prompt = [(11 * j) % 200 + 2 for j in range(length)]
        with AttentionTimer(engine.runner.backends[0], device) as attention:
            sync(device)
            start = time.perf_counter()
            _greedy(llm, [prompt], 1)
            sync(device)
            seconds = time.perf_counter() - start
        out[f"prefill_tok_s_{length}"] = length / seconds
        out[f"prefill_attention_share_{length}"] = attention.seconds() / seconds
    return out


class AttentionTimer:
    """Times every call of a paged backend's attention kernel (`attend`) while active: CUDA
    events around each call on a GPU, the wall clock (the twin is synchronous) on CPU."""

    def __init__(self, backend: Any, device: torch.device) -> None:
        self.backend, self.device = backend, device
        self.spans: list[tuple[Any, Any]] = []

    def __enter__(self) -> AttentionTimer:
        original, cuda = self.backend.attend, self.device.type == "cuda"

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            begin = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                begin.record()
            result = original(*args, **kwargs)
            end = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                end.record()
            self.spans.append((begin, end))
            return result

        self.backend.attend = timed  # the instance's, over the class's kernel
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.attend

    def seconds(self) -> float:
        if self.device.type != "cuda":
            return sum(end - begin for begin, end in self.spans)
        sync(self.device)
        return sum(begin.elapsed_time(end) for begin, end in self.spans) / 1e3
