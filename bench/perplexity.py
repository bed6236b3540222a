"""Perplexity and KL divergence of the default model's GGUF files (F32, Q8_0, Q4_1), dgpp beside
llama.cpp on the same files, the same text and the same windows (issue 44).

    .venv/bin/python bench/perplexity.py [--text FILE] [--tokens 8192] [--context 512]
                                         [--kv-cache-dtype auto|int8|fp8_e4m3|int4]

dgpp scores through `dgpp eval`'s own path (`dgpp.engine.evaluation.eval_scoring`: the engine's
chunked prefill with a score sink); llama.cpp through llama-cpp-python with every position's logits
(bench/llama_cpp_perplexity.py, in the venv bench/gguf_decode.py builds once, about 7 minutes,
outside the repository). Each engine's F32 run is its own reference: the KL of Q8_0 and Q4_1 is
measured against the same engine's F32, over the reference's top K tokens and one bucket for
the rest (`coarse_kl`); the last row is dgpp's F32 against llama.cpp's F32. The default text is
the GPL-3 from Debian's common licenses (on every Debian machine, about 8,000 tokens).
Prints a markdown table with the ratios; docs/quality.md records it. The KV column is each
side's KV cache (`--kv-cache-dtype`: every dgpp run at it, llama.cpp's at its counterpart, int8
q8_0 and int4 q4_0 with flash attention on, fp8 none: f16); bench/kv_cache_kld.py measures
the KV-cache dtypes themselves the same way.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dgpp.appliance.models.default import install_default
from dgpp.appliance.offline import LLM
from dgpp.engine.evaluation.eval_reference import perplexity
from dgpp.engine.evaluation.eval_scoring import Collector, Reference, coarse_kl, score_text, windows

sys.path.insert(0, str(Path(__file__).parent))
from gguf_decode import peer_python
from gguf_variants import variant

FORMATS = ("F32", "Q8_0", "Q4_1")
PEER_KV = {"auto": "f16", "int8": "q8_0", "fp8_e4m3": "f16", "int4": "q4_0"}


def dgpp_side(path: Path, tokens: list[int], spans: list, top_k: int, ref: Reference | None,
              prepare: Callable[[LLM], None] | None = None, **knobs: object) -> dict:  # fmt: skip
    """dgpp's scores of `spans` (`knobs`: engine knobs, e.g. kv_cache_dtype="int8"; `prepare`:
    what to do to the engine first)."""
    llm = LLM(str(path), kv_capacity=4096, **knobs)
    if prepare is not None:
        prepare(llm)
    collector = Collector(tokens, top_k if ref is None else 0, ref)
    started = time.perf_counter()
    score_text(llm.engine, collector, spans)
    return {
        "seconds": time.perf_counter() - started,
        "nll": collector.nll.numpy(),
        "top1": collector.top1.numpy(),
        "top_ids": collector.top_ids.numpy(),
        "top_logprobs": collector.top_logprobs.numpy(),
        "kl": collector.kl.numpy() if ref is not None else None,
        "dtype_bits": 8 * llm.engine.runner.dtype.itemsize,
        "head_dim": llm.engine.runner.model_config.head_dim,
    }


def peer_side(path: Path, tokens: list[int], spans: list, top_k: int, ref_ids: Path | None,
              threads: int, work: Path, **options: object) -> dict:  # fmt: skip
    """llama.cpp's scores of `spans` (`options`: `kv_type`, `flash_attn`; see
    bench/llama_cpp_perplexity.py)."""
    job = work / "job.json"
    job.write_text(
        json.dumps(
            {
                "tokens": tokens,
                "windows": [[s.begin, s.end, s.first] for s in spans],
                "top_k": top_k,
                "reference_ids": str(ref_ids) if ref_ids else None,
                **options,
            }
        )
    )
    out = work / "peer.npz"
    script = Path(__file__).with_name("llama_cpp_perplexity.py")
    command = [str(peer_python()), str(script), str(path), str(threads), str(job), str(out)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    data = dict(np.load(out))
    data["seconds"] = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return data


def kl_of(reference: dict, at_reference: np.ndarray) -> np.ndarray:
    return coarse_kl(
        torch.from_numpy(reference["top_logprobs"]), torch.from_numpy(at_reference)
    ).numpy()


def reference_of(side: dict) -> Reference:
    """A side's scores as the reference the others are measured against."""
    return Reference(
        torch.from_numpy(side["top_ids"]), torch.from_numpy(side["top_logprobs"]),
        -torch.from_numpy(side["nll"]),
    )  # fmt: skip


def text_tokens(model: Path, text: Path, limit: int) -> list[int]:
    """The first `limit` tokens of `text`, by `model`'s tokenizer."""
    return list(LLM(str(model), kv_capacity=64).tokenizer(text.read_text()).input_ids)[:limit]


def row(name: str, side: dict, ref: dict | None, computed: int) -> dict:
    result = {"name": name, **perplexity(torch.from_numpy(side["nll"]))}
    result["tokens_per_s"] = computed / side["seconds"]
    if ref is not None:
        result["kl"] = float(np.mean(side["kl"]))
        result["kl_p99"] = float(np.quantile(side["kl"], 0.99))
        result["same_top"] = float(np.mean(side["top1"] == ref["top_ids"][:, 0]))
    return result


def text_arguments(doc: str, tokens: int, context: int, top_k: int) -> argparse.ArgumentParser:
    """The scoring benches' common flags: the text, how many of its tokens, the window, the
    reference's top K."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--context", type=int, default=context)
    parser.add_argument("--top-k", type=int, default=top_k)
    return parser


def kl_cells(r: dict, reference: str) -> str:
    """A row's KL mean, p99 and same-top cells; `reference` and blanks for a reference row."""
    if "kl" not in r:
        return f"{reference} | | "
    return f"{r['kl']:.6f} | {r['kl_p99']:.6f} | {100 * r['same_top']:.2f}%"


def main() -> None:
    parser = text_arguments(__doc__, 8192, 512, 128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-dtype", default="auto", choices=sorted(PEER_KV))
    args = parser.parse_args()
    kv = {"kv_cache_dtype": args.kv_cache_dtype}
    peer_kv = PEER_KV[args.kv_cache_dtype]
    peer_kv_options = {} if peer_kv == "f16" else {"kv_type": peer_kv, "flash_attn": True}
    shipped = install_default() / "model.gguf"
    files = {fmt: shipped if fmt == "Q4_1" else variant(shipped, fmt) for fmt in FORMATS}
    tokens = text_tokens(shipped, args.text, args.tokens)
    spans = windows(len(tokens), args.context, args.context // 2)
    computed = sum(s.end - s.begin for s in spans)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ours = dgpp_side(files["F32"], tokens, spans, args.top_k, None, **kv)
        theirs = peer_side(files["F32"], tokens, spans, args.top_k, None, args.threads, work,
                           **peer_kv_options)  # fmt: skip
        np.savez(work / "theirs_ref.npz", top_ids=theirs["top_ids"])
        rows += [
            row("F32 dgpp", ours, None, computed),
            row("F32 llama.cpp", theirs, None, computed),
        ]
        own_ref = reference_of(ours)
        for fmt in FORMATS[1:]:
            print(f"{fmt} ...", file=sys.stderr)
            side = dgpp_side(files[fmt], tokens, spans, args.top_k, own_ref, **kv)
            peer = peer_side(files[fmt], tokens, spans, args.top_k, work / "theirs_ref.npz",
                             args.threads, work, **peer_kv_options)  # fmt: skip
            peer["kl"] = kl_of(theirs, peer["at_reference"])
            rows += [row(f"{fmt} dgpp", side, ours, computed)]
            rows += [row(f"{fmt} llama.cpp", peer, theirs, computed)]
        cross = dgpp_side(files["F32"], tokens, spans, args.top_k, reference_of(theirs), **kv)
        rows.append(row("F32 dgpp vs F32 llama.cpp", cross, theirs, computed))
    report(rows, args, len(tokens))


def report(rows: list[dict], args: argparse.Namespace, tokens: int) -> None:
    print(
        f"{args.text.name}: {tokens:,} tokens, windows of {args.context} every "
        f"{args.context // 2}, {args.threads} threads; KL against the same engine's F32 over "
        f"its top {args.top_k} + the rest"
    )
    print("| file, engine | KV | perplexity (95% interval) | ppl / llama.cpp's | KL mean | KL p99 "
          "| same top | tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    cache = {"dgpp": args.kv_cache_dtype, "llama.cpp": PEER_KV[args.kv_cache_dtype]}
    peers = {r["name"].split()[0]: r["ppl"] for r in rows if _is_peer(r["name"])}
    for r in rows:
        ratio = r["ppl"] / peers[r["name"].split()[0]]
        kl = kl_cells(r, "")
        side = "llama.cpp" if _is_peer(r["name"]) else "dgpp"
        print(
            f"| {r['name']} | {cache[side]} | {r['ppl']:.4f} ({r['ppl_low']:.3f} to "
            f"{r['ppl_high']:.3f}) | {ratio:.5f} | {kl} | {r['tokens_per_s']:,.0f} |"
        )


def _is_peer(name: str) -> bool:
    """llama.cpp's own rows ("Q8_0 llama.cpp"), not dgpp's against its reference ("... vs ...")."""
    return name.endswith(" llama.cpp") and " vs " not in name


if __name__ == "__main__":
    main()
