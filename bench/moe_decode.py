"""Decode speed of a small mixture-of-experts model (Qwen3-MoE layout, random weights), dgpp
against transformers on the same weights in one run, and where dgpp's MoE time goes:

    python bench/moe_decode.py [--layers 6 --experts 32 --top-k 4]

Greedy decode of 64 tokens after a 32-token prompt (after an 8-token warm-up), batch 1 and a
batch of 8 prompts for dgpp; transformers' `generate` with its KV cache, batch 1. The time
share is measured with forward hooks on dgpp's routers and expert groups during the batch-1
decode. Both use `torch.get_num_threads()` threads, float32.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers

from dgpp.appliance.models.default import default_model_path, install_default, is_complete
from dgpp.engine import LLM, SamplingParams
from dgpp.engine.layers.moe import Experts
from dgpp.engine.layers.router import Router

NEW_TOKENS = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build(out: Path, layers: int, experts: int, top_k: int) -> Path:
    config = transformers.Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=1024,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(str(out))
    source = default_model_path() if is_complete(default_model_path()) else install_default()
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


class HookTimer:
    """Wall time spent inside modules of the given types (CPU: synchronous)."""

    def __init__(self, model: torch.nn.Module, kinds: tuple[type, ...]) -> None:
        self.seconds = {kind.__name__: 0.0 for kind in kinds}
        self._started: dict[int, float] = {}
        for module in model.modules():
            if isinstance(module, kinds):
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._leave)

    def _enter(self, module: torch.nn.Module, args: object) -> None:
        self._started[id(module)] = time.perf_counter()

    def _leave(self, module: torch.nn.Module, args: object, out: object) -> None:
        spent = time.perf_counter() - self._started.pop(id(module))
        self.seconds[type(module).__name__] += spent

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def dgpp_decode(checkpoint: Path, prompts: list[list[int]]) -> tuple[float, float, dict]:
    llm = LLM(str(checkpoint), kv_capacity=4096, max_concurrency=16)
    timer = HookTimer(llm.engine.runner.model, (Router, Experts))
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([prompts[0]], warm)
    timer.reset()
    started = time.perf_counter()
    llm.generate([prompts[0]], params)
    wall = time.perf_counter() - started
    shares = {name: seconds / wall for name, seconds in timer.seconds.items()}
    started = time.perf_counter()
    llm.generate(prompts, params)
    batched = len(prompts) * NEW_TOKENS / (time.perf_counter() - started)
    return NEW_TOKENS / wall, batched, shares


def hf_decode(checkpoint: Path, prompt: list[int]) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kwargs)
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kwargs)
    return NEW_TOKENS / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (32,), generator=generator).tolist() for _ in range(8)]
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = build(Path(folder), args.layers, args.experts, args.top_k)
        single, batched, shares = dgpp_decode(checkpoint, prompts)
        reference = hf_decode(checkpoint, prompts[0])
    print(
        f"tiny Qwen3-MoE: {args.layers} layers, {args.experts} experts, top-{args.top_k}, "
        f"hidden 512, expert width 256, {torch.get_num_threads()} threads, float32"
    )
    print("| engine | decode batch 1 (tok/s) | batch 8 (tok/s) |")
    print("|---|---|---|")
    print(f"| dgpp | {single:.1f} | {batched:.1f} |")
    print(f"| transformers | {reference:.1f} | - |")
    print(f"dgpp / transformers at batch 1: {single / reference:.2f}x")
    print(
        f"dgpp batch-1 decode time in routers: {shares['Router']:.1%}, "
        f"in routed experts: {shares['Experts']:.1%}"
    )


if __name__ == "__main__":
    main()
