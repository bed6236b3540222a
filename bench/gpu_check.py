"""The prepared GPU check (issue 36): one run of a few minutes on one GPU, printing one short
table last and writing the whole log and a JSON of every figure into `--out DIR`.

    python bench/gpu_check.py --out DIR          # on a CUDA machine
    python bench/gpu_check.py --dry-run --out DIR  # the same code paths on CPU, tiny sizes

It needs PyTorch, Triton and transformers only (no FastAPI, llguidance, gguf or fla-core, no
network): run from a checkout, dgpp need not be installed (the checkout's folders are mapped to
`dgpp.*` here when it is not). Sections:
(a) every Triton kernel against its PyTorch twin at a real model's sizes (`gpu_check_kernels`);
(b) greedy parity with transformers in float32 on random tiny Llama and Qwen3-MoE checkpoints,
    and in bfloat16 the share of positions whose top-1 token agrees with transformers' bfloat16
    run and the largest logit difference;
(c) decode ms/token of a 1.45B Llama-shaped random model at batch 1 and 16, eager and with CUDA
    graphs, against weight bytes / copy bandwidth measured in the same run, and graphed greedy
    tokens against eager (the dry run: through the graphs' static buffers, not captured);
(d) prefill tok/s of one 4K and one 32K prompt, and attention's share of each (the attention
    kernel's calls timed with CUDA events).
(s) the start-up self-check at real checkpoints' per-rank shapes: each kernel's verdict, the
    first start's seconds and a restart's on its cache (`gpu_check_selfcheck`);
(e) the hybrid models' Gated DeltaNet kernels (fla-core's on CUDA, unpacked from the wheels in
    bench/wheels/ where the image lacks it) against dgpp's twins, and a tiny random Qwen3-Next's
    greedy parity with transformers and its CUDA-graphed tokens against eager
    (`gpu_check_hybrid`).
The fused MoE and MLA decode kernels are in (a), and the MoE parity run of (b) goes through the
fused MoE on CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def importable_dgpp() -> None:
    """`dgpp.*` from this checkout when dgpp is not installed: a `dgpp` folder of links to the
    folders pyproject maps (a namespace package), first on `sys.path`."""
    if importlib.util.find_spec("dgpp") is not None:
        return
    links = Path(tempfile.mkdtemp(prefix="dgpp-check-")) / "dgpp"
    links.mkdir()
    for folder in ("engine", "kernels", "appliance", "webui"):
        (links / folder).symlink_to(ROOT / folder, target_is_directory=True)
    sys.path.insert(0, str(links.parent))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpreted")
    parser.add_argument("--out", type=Path, required=True, help="folder for the log and JSON")
    parser.add_argument("--sections", default="s,a,b,c,e", help="s, a, b, c (with d) and e")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
        handlers=[logging.FileHandler(args.out / "gpu_check.log"), logging.StreamHandler()],
    )
    log = logging.getLogger("gpu_check")
    importable_dgpp()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check_hybrid import carry_wheels

    if not args.dry_run:  # fla-core and einops from bench/wheels where the image lacks them
        log.info("unpacked from bench/wheels: %s", carry_wheels() or "nothing (all importable)")
    import torch
    from gpu_check_hybrid import hybrid
    from gpu_check_kernels import check_kernels
    from gpu_check_models import decode_and_prefill, parity

    if not args.dry_run and not torch.cuda.is_available():
        log.error("no CUDA device: run with --dry-run on a CPU")
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    figures: dict[str, object] = {
        "device": name,
        "torch": torch.__version__,
        "dry_run": args.dry_run,
    }
    failed: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    sections = set(args.sections.split(","))
    started = time.perf_counter()
    if "s" in sections:
        try:
            from gpu_check_selfcheck import selfcheck_section

            figures["selfcheck"] = checked = selfcheck_section(device, args.dry_run)
            failed += [f"self-check {row['model']}" for row in checked if row["failures"]]
        except Exception:
            log.error("section s failed:\n%s", traceback.format_exc())
            failed.append("section s raised")
    if "a" in sections:
        try:
            kernels = check_kernels(device, args.dry_run, 1 if args.dry_run else 20)
            figures["kernels"] = [dict(vars(k), ok=k.ok) for k in kernels]
            failed += [f"kernel {k.name} {k.dtype}" for k in kernels if not k.ok]
        except Exception:
            log.error("section a failed:\n%s", traceback.format_exc())
            failed.append("section a raised")
    if "b" in sections:
        try:
            figures["parity"] = results = parity(device, work)
            failed += [f"greedy {r['model']}" for r in results if not r["float32_greedy_equal"]]
        except Exception:
            log.error("section b failed:\n%s", traceback.format_exc())
            failed.append("section b raised")
    if "c" in sections:
        try:
            figures["decode"] = decode = decode_and_prefill(device, work, args.dry_run)
            if not decode["graphed_equals_eager"]:
                failed.append("graphed greedy tokens differ from eager")
        except Exception:
            log.error("section c failed:\n%s", traceback.format_exc())
            failed.append("section c raised")
    if "e" in sections:
        try:
            figures["hybrid"] = found = hybrid(device, work, args.dry_run)
            figures["kernels"] = [
                *figures.get("kernels", []),
                *(dict(vars(k), ok=k.ok) for k in found["kernels"]),
            ]
            figures["parity"] = [*figures.get("parity", []), found["parity"]]
            failed += [f"kernel {k.name} {k.dtype}" for k in found["kernels"] if not k.ok]
            if not found["parity"]["float32_greedy_equal"]:
                failed.append(f"greedy {found['parity']['model']}")
            if found["graphed_equals_eager"] is False:
                failed.append("graphed Qwen3-Next tokens differ from eager")
            del found["kernels"]
        except Exception:
            log.error("section e failed:\n%s", traceback.format_exc())
            failed.append("section e raised")
    figures["seconds"] = time.perf_counter() - started
    figures["failed"] = failed
    (args.out / "gpu_check.json").write_text(json.dumps(figures, indent=2, default=str) + "\n")
    print(render(figures))
    return 1 if failed else 0


def render(figures: dict) -> str:
    """The short table printed last."""
    lines = [f"# dgpp GPU check on {figures['device']} (torch {figures['torch']})", ""]
    lines += ["| check | dtype | result | kernel ms | twin ms |", "|---|---|---|---|---|"]
    for k in figures.get("kernels", []):
        verdict = f"{'ok' if k['ok'] else 'FAIL'} {k['error']:.1e} < {k['tolerance']:.0e}"
        timing = f"{k['kernel_ms']:.3f} | {k['twin_ms']:.3f}"
        lines.append(f"| {k['name']} | {k['dtype']} | {verdict} | {timing} |")
    for row in figures.get("selfcheck", []):
        verdict = (
            "ok"
            if not row["failures"]
            else "FAIL " + ", ".join(f"{f['kernel']} ({f['failure']})" for f in row["failures"])
        )
        starts = f"first start {row['first_start_s']:.1f} s, cached {row['cached_start_s']:.2f} s"
        lines.append(
            f"| self-check {row['model']} tp{row['tp']}, {row['cases']} cases | {row['dtype']} "
            f"| {verdict}; {starts} | | |"
        )
    for r in figures.get("parity", []):
        equal = "equal" if r["float32_greedy_equal"] else "FAIL"
        lines.append(f"| greedy parity {r['model']} | float32 | {equal} | | |")
        agreement = f"{r['bf16_top1_agreement']:.1%}, max logit diff {r['bf16_max_logit_diff']:.3f}"
        lines.append(f"| top-1 agreement {r['model']} | bfloat16 | {agreement} | | |")
    decode = figures.get("decode")
    if decode:
        steps = f"b1 {decode['decode_ms_b1']:.2f} ms, b16 {decode['decode_ms_b16']:.2f} ms"
        if "decode_ms_b1_graphed" in decode:
            steps += (
                f"; graphed b1 {decode['decode_ms_b1_graphed']:.2f} ms, "
                f"b16 {decode['decode_ms_b16_graphed']:.2f} ms"
            )
        graphed = "graphed == eager" if decode["graphed_equals_eager"] else "graphed != eager"
        roof = f"roofline {decode['roofline_ms']:.2f} ms ({decode['copy_GBps']:.0f} GB/s copy)"
        lines.append(
            f"| decode, random Llama | {decode['weight_GB']:.2f} GB | {steps}; {roof}; "
            f"{graphed} | | |"
        )
        prefill = ", ".join(
            f"{key.rsplit('_', 1)[1]}: {value:.0f} tok/s (attention "
            f"{decode['prefill_attention_share_' + key.rsplit('_', 1)[1]]:.0%})"
            for key, value in decode.items()
            if key.startswith("prefill_tok_s")
        )
        lines.append(f"| prefill, one prompt | | {prefill} | | |")
    hybrid = figures.get("hybrid") or {}
    if hybrid.get("graphed_equals_eager") is not None:
        same = "equal" if hybrid["graphed_equals_eager"] else "FAIL"
        lines.append(f"| graphed vs eager greedy, tiny Qwen3-Next | float32 | {same} | | |")
    verdict = "all passed" if not figures["failed"] else "FAILED: " + "; ".join(figures["failed"])
    lines += ["", f"{verdict} ({figures['seconds']:.0f} s)"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
