"""Command-line flags for the engine knobs, shared by every command that starts an engine."""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="checkpoint dir, HF repo id, or 'default' (the default)"
    )
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    group.add_argument("--kv-capacity", type=int, default=None, help="tokens the KV pool holds")
    group.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    group.add_argument("--max-model-len", type=int, default=None, help="per-request context limit")
    group.add_argument("--max-concurrency", type=int, default=None)
    group.add_argument(
        "--prefill-chunk-tokens", type=int, default=None, help="prompt tokens per step (512)"
    )
    group.add_argument(
        "--short-prompt-tokens",
        type=int,
        default=None,
        help="prompts with at most this many tokens left go before long ones (256)",
    )
    group.add_argument(
        "--long-prefill-share",
        type=float,
        default=None,
        help="share of a step's prompt budget the oldest long prompt keeps while short ones "
        "are served (0.25)",
    )
    group.add_argument(
        "--step-target-ms",
        type=float,
        default=None,
        help="while streams decode, steps with prompt work stay near this time (0, the "
        "default: twice the decode-only step; negative: unbounded)",
    )
    group.add_argument("--prefill-precision", choices=["fp32", "model"], default=None)
    group.add_argument(
        "--quantization",
        default=None,
        help="auto (the default): as the checkpoint stores it; a method (gguf, gptq, awq, "
        "auto-round, compressed-tensors, fp8, modelopt, mxfp4, none) refuses any other",
    )
    group.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        default=None,
        help="turn the prefix cache off",
    )
    group.add_argument(
        "--prefix-min-tokens",
        type=int,
        default=None,
        help="prompts shorter than this may hit the prefix cache but add nothing to it (1024)",
    )
    group.add_argument(
        "--prefix-cache-gib",
        type=float,
        default=None,
        help="memory per rank for the prefix cache's recurrent-state snapshots (hybrid models "
        "such as Qwen3-Next; 4.0)",
    )
    group.add_argument(
        "--spec",
        choices=["off", "ngram"],
        default=None,
        dest="speculative",
        help="speculative decoding: 'ngram' drafts from the request's own history (prompt "
        "lookup) and verifies the drafts in one forward; output is unchanged",
    )
    group.add_argument(
        "--no-spec",
        dest="speculative",
        action="store_const",
        const="off",
        help="turn speculative decoding off, whatever the deployment says",
    )
    group.add_argument(
        "--spec-depth", type=int, default=None, help="draft tokens per step at most (4)"
    )
    group.add_argument(
        "--spec-ngram-max", type=int, default=None, help="longest n-gram looked up (4)"
    )
    group.add_argument(
        "--spec-ngram-min", type=int, default=None, help="shortest n-gram looked up (2)"
    )
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--threads", type=int, default=None, dest="num_threads")
    group.add_argument(
        "--no-resident-cache",
        dest="resident_cache",
        action="store_false",
        default=None,
        help="neither read nor write the resident weight image",
    )
    group.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="share of the device memory (host RAM on CPU) this rank may use; sizes the KV pool "
        "from what the weights leave of it, overriding --kv-capacity",
    )
    group.add_argument(
        "--mlock",
        action="store_true",
        default=None,
        help="pin the weights and KV pool in RAM (needs LimitMEMLOCK=infinity or ulimit -l)",
    )


def engine_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs the user set, as `EngineConfig` keyword arguments (unset ones keep defaults)."""
    names = (
        "dtype",
        "device",
        "kv_capacity",
        "block_size",
        "max_model_len",
        "max_concurrency",
        "prefill_chunk_tokens",
        "short_prompt_tokens",
        "long_prefill_share",
        "step_target_ms",
        "prefill_precision",
        "quantization",
        "prefix_cache",
        "prefix_min_tokens",
        "prefix_cache_gib",
        "seed",
        "num_threads",
        "memory_fraction",
        "mlock",
        "speculative",
        "spec_depth",
        "spec_ngram_max",
        "spec_ngram_min",
    )
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.sample_seed,
        "stop": tuple(args.stop),
    }
