"""`dgpp eval perplexity` and `dgpp eval kld`: what a quantization or a knob costs, measured on
the operator's own checkpoint and text through the engine's own prefill path
(`dgpp.engine.evaluation.eval_scoring`); docs/quality.md."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from dgpp.appliance.commands.engine_options import add_engine_options
from dgpp.appliance.commands.serve import serve_deployment
from dgpp.appliance.common.exit_codes import EXIT_OK
from dgpp.appliance.deployments.deployment import checkpoint_of, engine_config
from dgpp.engine.errors import ConfigError

MAX_TOP_K = 1024  # reference log-probabilities kept per token


def add_eval_parser(commands: Any) -> None:
    parser = commands.add_parser("eval", help="perplexity and KL divergence of a deployment")
    kinds = parser.add_subparsers(dest="eval_command", required=True)
    ppl = kinds.add_parser("perplexity", help="perplexity over a text file, with its 95%% interval")
    kld = kinds.add_parser(
        "kld", help="KL divergence from a reference run (save one with --save-reference)"
    )
    for each in (ppl, kld):
        each.add_argument("text", type=Path, help="a UTF-8 text file")
        each.add_argument("--deployment", default=None, help="its model and engine knobs")
        each.add_argument(
            "--context",
            type=int,
            default=None,
            help="window tokens (512, or what one request may score)",
        )
        each.add_argument(
            "--stride", type=int, default=None, help="tokens between windows (context / 2)"
        )
        each.add_argument(
            "--max-text-tokens", type=int, default=None, help="score only the text's first N"
        )
        each.add_argument("--json", action="store_true", help="print the figures as JSON")
        add_engine_options(each)
    which = kld.add_mutually_exclusive_group(required=True)
    which.add_argument("--save-reference", type=Path, metavar="FILE", help="write a reference")
    which.add_argument("--reference", type=Path, metavar="FILE", help="compare with a reference")
    kld.add_argument(
        "--top-k", type=int, default=32, help="log-probabilities kept per token in a reference"
    )


def read_text(path: Path) -> tuple[str, str]:
    """The file's text and the sha256 of its bytes; `ConfigError` for an empty or binary file."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}", param="text") from None
    if not data.strip():
        raise ConfigError(f"{path} is empty: there is no text to score", param="text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {err.start}): give a text file", param="text"
        ) from None
    if "\x00" in text:
        raise ConfigError(f"{path} holds NUL bytes: a binary file, not text", param="text")
    return text, hashlib.sha256(data).hexdigest()


def run_eval(args: argparse.Namespace) -> int:
    from dgpp.engine.evaluation import eval_reference as figures
    from dgpp.engine.evaluation.eval_scoring import Collector, score_text, windows

    text, text_digest = read_text(args.text)
    top_k = 0
    if getattr(args, "save_reference", None) is not None:
        top_k = args.top_k
        if not 1 <= top_k <= MAX_TOP_K:
            raise ConfigError(f"--top-k must be in [1, {MAX_TOP_K}], got {top_k}", param="top_k")
    reference = identity_ref = None
    if getattr(args, "reference", None) is not None:
        reference, identity_ref, _ = figures.load_reference(args.reference)
    engine, model = _engine(args)
    tokens = list(engine.tokenizer(text).input_ids)[: args.max_text_tokens]
    if len(tokens) < 2:
        raise ConfigError(f"{args.text} has {len(tokens)} token(s); scoring needs 2", param="text")
    limit = min(engine.max_model_len - 1, engine.config.max_scored_prompt_tokens)
    context = args.context or (identity_ref.context if identity_ref else min(512, limit))
    stride = args.stride or (identity_ref.stride if identity_ref else max(1, context // 2))
    if context > limit:
        raise ConfigError(
            f"--context {context} exceeds what one request may score here ({limit} tokens: "
            "max_model_len - 1 and engine.max_scored_prompt_tokens)",
            param="context",
        )
    identity = figures.Identity(
        figures.tokenizer_digest(engine.tokenizer),
        text_digest,
        figures.tokens_digest(tokens),
        context,
        stride,
    )
    if identity_ref is not None:
        figures.check_match(identity_ref, identity)
    collector = Collector(tokens, top_k, reference)
    spans = windows(len(tokens), context, stride)
    seconds = score_text(engine, collector, spans, _progress(sys.stderr))
    computed = sum(span.end - span.begin for span in spans)
    result: dict[str, Any] = {
        "model": model,
        "text": str(args.text),
        "context": context,
        "stride": stride,
        "seconds": seconds,
        "tokens_per_s": computed / seconds,
        **figures.perplexity(collector.nll),
    }
    if args.eval_command == "kld" and reference is not None:
        result.update(figures.divergence(collector, reference))
    if args.eval_command == "kld" and args.save_reference is not None:
        figures.save_reference(args.save_reference, collector, identity, model)
        result["saved"] = str(args.save_reference)
    print(json.dumps(result, indent=2) if args.json else _report(result))
    return EXIT_OK


def _engine(args: argparse.Namespace) -> tuple[Any, str]:
    """An engine with the deployment's model and knobs (the flags over them), at world 1."""
    deployment = serve_deployment(args)
    if deployment.world_size > 1:
        print(
            "dgpp eval: the deployment's engine knobs in one process (it serves "
            f"{deployment.world_size} ranks; tensor parallelism changes only rounding)",
            file=sys.stderr,
        )
    from dgpp.appliance.common.paths import resident_dir
    from dgpp.engine.engine import LLMEngine
    from dgpp.engine.planning.resolved import resolve as resolve_config

    config = engine_config(deployment)
    engine = LLMEngine(
        resolve_config(config, checkpoint_of(deployment)), resident_dir=resident_dir()
    )
    return engine, deployment.model


def _progress(out: Any) -> Any:
    last = [-1]

    def show(done: int, total: int, seconds: float) -> None:
        tenth = 10 * done // max(total, 1)
        if out.isatty() or tenth != last[0]:
            last[0] = tenth
            rate = done / seconds if seconds > 0 else 0.0
            end = "\r" if out.isatty() and done < total else "\n"
            out.write(f"scored {done:,}/{total:,} tokens, {rate:,.0f} tokens/s{end}")
            out.flush()

    return show


def _report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} on {result['text']}: {result['tokens']:,} tokens scored in windows "
        f"of {result['context']} every {result['stride']} ({result['seconds']:.1f} s, "
        f"{result['tokens_per_s']:,.0f} tokens/s)",
        f"perplexity {result['ppl']:.4f} (95% interval {result['ppl_low']:.4f} to "
        f"{result['ppl_high']:.4f}; mean NLL {result['nll']:.5f})",
    ]
    if "kl_mean" in result:
        lines.append(
            f"KL divergence from the reference (its top {result['top_k']} tokens + the rest, "
            f"{100 * result['reference_mass']:.1f}% of its mass): mean {result['kl_mean']:.6f} "
            f"± {result['kl_se']:.6f}"
        )
        pct = result["kl_percentiles"]
        lines.append(
            "  "
            + ", ".join(f"p{k} {v:.6f}" for k, v in pct.items())
            + f", max {result['kl_max']:.6f}"
        )
        lines.append(
            f"same top token {100 * result['same_top']:.2f}% (changed at "
            f"{100 * result['top_changed']:.2f}% of positions); RMS Δp "
            f"{100 * result['rms_delta_p']:.3f}%"
        )
        lines.append(
            f"perplexity {result['ppl']:.4f} against the reference's "
            f"{result['ppl_reference']:.4f}: "
            f"Δppl {result['delta_ppl']:+.4f}, ln ratio {result['ln_ppl_ratio']:+.5f} "
            f"± {result['ln_ppl_ratio_se']:.5f}"
        )
    if "saved" in result:
        lines.append(f"reference written to {result['saved']}")
    return "\n".join(lines)
