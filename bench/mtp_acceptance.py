"""MTP drafting against plain decoding and n-gram drafting, on a tiny DeepSeek-V3 (or, with
`--family qwen3-next`, a tiny hybrid Qwen3-Next) whose MTP layer is trained here on the target's
own greedy outputs (random weights accept nothing).

    .venv/bin/python bench/mtp_acceptance.py [--family deepseek-v3|qwen3-next] [--steps 300]
        [--threads 2] [--repeats 3] [--json out.json]

1. A random DeepSeek-V3 (hidden 256, 4 layers, 16 experts, a 2,048-word vocabulary) is built
   and saved by transformers, with a word-level tokenizer; or a Qwen3-Next of the same widths
   (three Gated DeltaNet layers, then one gated full-attention layer; every MLP sparse), whose
   verify rows also keep each position's recurrent state (issue 37).
2. dgpp decodes 64 random prompts greedily (128 tokens each); transformers gives the target's
   final hidden states over each whole sequence.
3. The MTP layer (enorm, hnorm, eh_proj, one decoder layer, shared-head norm; the target's
   embedding and LM head frozen) is trained with Adam to predict token i + 2 from the hidden
   state at i and token i + 1, on those sequences (CPU, a few minutes), and appended to the
   checkpoint as `model.layers.4.*` (Qwen3-Next: `mtp.*`, zero-centred norms, the target's LM
   head), as released checkpoints store theirs.
4. On 16 of the training prompts (where the layer agrees with its target, as a released
   checkpoint's trained layer does; a random target's greedy text is a hash of its context, so
   on unseen prompts the layer agrees little, and that acceptance is printed too), dgpp decodes
   plain, with n-gram drafts (depth 4) and with MTP drafts at fixed depths 1, 2 and 4 and at an
   adaptive depth of at most 4, in one process, in `--repeats` interleaved rounds:
   decode tok/s (the median round), the ratio to plain, acceptance (accepted / drafted tokens)
   and mean tokens per verify row. The outputs should equal plain decoding's; where float32
   sums in another order flip a near-tie (a token's, or a MoE router's), the differing outputs
   and their first different token are printed and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_build import random_checkpoint

from dgpp.engine import LLM, SamplingParams

SIZES = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=64,
    kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, vocab_size=2048,
    max_position_embeddings=1024, num_nextn_predict_layers=1,
)  # fmt: skip
QWEN_SIZES = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    shared_expert_intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[], linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
    full_attention_interval=4, vocab_size=2048, max_position_embeddings=1024,
)  # fmt: skip
FAMILIES = {
    "deepseek-v3": ("DeepseekV3ForCausalLM", SIZES),
    "qwen3-next": ("Qwen3NextForCausalLM", QWEN_SIZES),
}
NEW_TOKENS = 128


def prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, SIZES["vocab_size"], (16,), generator=gen).tolist() for _ in range(count)
    ]


def greedy(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(batch, params)]


def _mtp_modules(config: Any) -> tuple[torch.nn.Module, type, torch.nn.Module, float]:
    """The family's decoder block for the MTP layer, its RMSNorm class, its rotary embedding
    and the norms' initial weight (1, or 0 for zero-centred norms)."""
    if config.model_type == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as qn

        full = list(config.layer_types).index("full_attention")
        block = qn.Qwen3NextDecoderLayer(config, full)
        return block, qn.Qwen3NextRMSNorm, qn.Qwen3NextRotaryEmbedding(config), 0.0
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    block = hf.DeepseekV3DecoderLayer(config, config.num_hidden_layers)
    return block, hf.DeepseekV3RMSNorm, hf.DeepseekV3RotaryEmbedding(config), 1.0


def train_mtp(checkpoint: Path, sequences: list[list[int]], steps: int) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors, trained on (hidden_i, token_{i+1}) -> token_{i+2}."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    config = target.config
    ids = torch.tensor(sequences)
    with torch.no_grad():
        hidden = target.model(ids).last_hidden_state  # final-normed, as dgpp keeps it
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    width = config.hidden_size
    block, norm_class, rotary, norm_init = _mtp_modules(config)
    block = block.float()
    with torch.no_grad():  # a bare layer leaves some parameters uninitialised
        for name, param in block.named_parameters():
            param.copy_(
                torch.full_like(param, norm_init)
                if name.endswith("norm.weight")
                else 0.02 * torch.randn_like(param)
            )
    norms = torch.nn.ModuleDict({k: norm_class(width, config.rms_norm_eps) for k in "ehs"})
    eh_proj = torch.nn.Linear(2 * width, width, bias=False)
    params = [*block.parameters(), *norms.parameters(), *eh_proj.parameters()]
    optimizer = torch.optim.Adam(params, lr=2e-3)
    length = ids.shape[1] - 2
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    positions = torch.arange(length)[None]
    cos_sin = rotary(hidden[:1, :length], positions)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        pick = torch.randint(0, ids.shape[0], (8,), generator=gen)
        x = torch.cat(
            (norms["e"](embed[ids[pick, 1 : length + 1]]), norms["h"](hidden[pick, :length])), -1
        )
        g = block(
            eh_proj(x), attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
        )
        g = g[0] if isinstance(g, tuple) else g
        logits = norms["s"](g) @ head.T
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[pick, 2:].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step}: loss {loss.item():.3f}", flush=True)
    state = _per_expert(block.state_dict())
    if config.model_type == "qwen3_next":
        own = {
            "pre_fc_norm_embedding.weight": norms["e"].weight,
            "pre_fc_norm_hidden.weight": norms["h"].weight,
            "norm.weight": norms["s"].weight,
            "fc.weight": eh_proj.weight,
            **{f"layers.0.{k}": v for k, v in state.items()},
        }
        return {f"mtp.{k}": v.detach().contiguous() for k, v in own.items()}
    state["enorm.weight"], state["hnorm.weight"] = norms["e"].weight, norms["h"].weight
    state["shared_head.norm.weight"] = norms["s"].weight
    state["eh_proj.weight"], state["shared_head.head.weight"] = eh_proj.weight, head.clone()
    index = config.num_hidden_layers
    return {f"model.layers.{index}.{k}": v.detach().contiguous() for k, v in state.items()}


def _per_expert(block_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A trained block's tensors with its stacked experts under the per-expert names released
    checkpoints use."""
    state = {k: v.detach() for k, v in block_state.items() if ".experts." not in k}
    gate_up, down = block_state["mlp.experts.gate_up_proj"], block_state["mlp.experts.down_proj"]
    inner = down.shape[-1]
    for expert in range(gate_up.shape[0]):
        state[f"mlp.experts.{expert}.gate_proj.weight"] = gate_up[expert, :inner].detach().clone()
        state[f"mlp.experts.{expert}.up_proj.weight"] = gate_up[expert, inner:].detach().clone()
        state[f"mlp.experts.{expert}.down_proj.weight"] = down[expert].detach().clone()
    return state


def measure(
    checkpoint: Path, batch: list[list[int]], threads: int, runs: dict[str, dict], repeats: int
) -> dict[str, dict[str, Any]]:
    """Every run's engine built once and warmed up, then `repeats` rounds, each timing every
    run once in turn (slow drifts of a shared machine fall on all runs alike): the median
    decode rate, the acceptance and tokens per verify row over all rounds, the last tokens."""
    engines = {}
    for name, knobs in runs.items():
        llm = LLM(str(checkpoint), kv_capacity=8192, block_size=16, num_threads=threads, **knobs)
        greedy(llm, batch[:2])  # warm-up
        engines[name] = llm
    rates: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, llm in engines.items():
            started = time.perf_counter()
            tokens[name] = greedy(llm, batch)
            rates[name].append(sum(map(len, tokens[name])) / (time.perf_counter() - started))
    results = {}
    for name, llm in engines.items():
        spec = llm.engine.stats().counters.spec_decode
        results[name] = {
            "tokens": tokens[name],
            "tok_s": statistics.median(rates[name]),
            "tok_s_all": rates[name],
            "acceptance": spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else None,
            "tokens_per_row": (spec.accepted_tokens + spec.drafts) / spec.drafts
            if spec.drafts
            else None,
        }
    return results


def first_differences(plain: list[list[int]], other: list[list[int]]) -> dict[int, int]:
    """Per output that differs from plain decoding's, the index of its first different token."""
    found = {}
    for index, (a, b) in enumerate(zip(plain, other, strict=True)):
        if a != b:
            found[index] = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="deepseek-v3")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="mtp-bench-"))
    architecture, sizes = FAMILIES[args.family]
    checkpoint = random_checkpoint(work / args.family, architecture, sizes, torch.device("cpu"))
    plain = LLM(str(checkpoint), kv_capacity=16384, block_size=16, num_threads=args.threads)
    train_prompts = prompts(64, seed=1)
    started = time.perf_counter()
    sequences = [
        p + out for p, out in zip(train_prompts, greedy(plain, train_prompts), strict=True)
    ]
    del plain
    took = time.perf_counter() - started
    print(f"target outputs: {len(sequences)} x {NEW_TOKENS} tokens ({took:.0f} s)")
    started = time.perf_counter()
    tensors = train_mtp(checkpoint, sequences, args.steps)
    print(f"MTP layer trained: {args.steps} steps ({time.perf_counter() - started:.0f} s)")
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file(
        {**weights, **tensors}, str(checkpoint / "model.safetensors"), metadata={"format": "pt"}
    )
    unseen = measure(
        checkpoint,
        prompts(16, seed=2),
        args.threads,
        {"mtp d4": dict(speculative="mtp", spec_adaptive=False)},
        1,
    )["mtp d4"]
    print(f"MTP d4 acceptance on 16 prompts it was not trained on: {unseen['acceptance']:.1%}")
    batch = train_prompts[:16]  # where the layer agrees with its target, as a trained one does
    runs = {
        "plain": {},
        "ngram d4": dict(speculative="ngram", spec_depth=4),
        "mtp d1": dict(speculative="mtp", spec_depth=1, spec_adaptive=False),
        "mtp d2": dict(speculative="mtp", spec_depth=2, spec_adaptive=False),
        "mtp d4": dict(speculative="mtp", spec_depth=4, spec_adaptive=False),
        "mtp adaptive (at most 4)": dict(speculative="mtp", spec_depth=4, spec_adaptive=True),
    }
    results = measure(checkpoint, batch, args.threads, runs, args.repeats)
    base = results["plain"]
    print("\n| run | decode tok/s | vs plain | acceptance | tokens per verify row |")
    print("|---|---|---|---|---|")
    for name, found in results.items():
        acceptance = "" if found["acceptance"] is None else f"{found['acceptance']:.1%}"
        per_row = "" if found["tokens_per_row"] is None else f"{found['tokens_per_row']:.2f}"
        ratio = found["tok_s"] / base["tok_s"]
        print(f"| {name} | {found['tok_s']:.1f} | {ratio:.2f}x | {acceptance} | {per_row} |")
    same = True
    for name, found in results.items():
        # float32 sums in another order: a near-tie (a token's, a router's) may flip
        differ = first_differences(base["tokens"], found["tokens"])
        if differ:
            same = False
            print(f"{name}: {len(differ)} of {len(batch)} outputs differ, at {differ}")
    print(f"\noutputs equal plain decoding's: {same}")
    if args.json:
        summary = {k: {f: v for f, v in r.items() if f != "tokens"} for k, r in results.items()}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
