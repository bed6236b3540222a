"""DeepSeek-V4's MTP layer (`mtp.0.*`, which transformers does not load) as `speculative: mtp`'s
draft layer: one pass equals DeepSeek's formula computed with transformers' own decoder layer
and hyper-head on the same weights; speculative output equals plain output, its drafts
rejected (random weights) or all accepted (an oracle standing in for a trained layer); the
memory plan holds the layer's weights and paged window keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.backends.base import BatchLayout, BatchRow
from tests.conftest import build_tiny_checkpoint, tiny_model
from tests.engine.models.test_deepseek_v4 import TINY
from tests.engine.speculative.mtp_checks import check_mtp_memory_plan, oracle_draft_pass

PROMPTS = [[5, 17, 99, 3, 42], list(range(100, 137)), [7, 8, 9] * 6]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KNOBS = dict(kv_capacity=512, block_size=4, prefill_chunk_tokens=16)
H, STREAMS = 64, 2
# The draft layer: a sliding layer with scored experts, as the release's MTP layer is.
DRAFT = {**TINY, "num_hidden_layers": 1, "layer_types": ["sliding_attention"]}
DRAFT.update(num_hash_layers=0, mlp_layer_types=["moe"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny V4 with an MTP layer under the release's names: a one-layer model's layer (its
    tensors as transformers saves them: the release's names), hyper-head and norm, plus the
    layer's own projections and norms."""
    root = tmp_path_factory.mktemp("deepseek-v4-mtp")
    path = build_tiny_checkpoint(root / "v4", tokenizer_dir, "DeepseekV4ForCausalLM", **TINY)
    tiny_model("DeepseekV4ForCausalLM", 7, **DRAFT).save_pretrained(str(root / "draft"))
    draft = load_file(str(next((root / "draft").glob("*.safetensors"))))
    mtp = {f"mtp.0.{k.removeprefix('model.layers.0.')}": v for k, v in draft.items()}
    mtp = {k: v for k, v in mtp.items() if not k.startswith(("mtp.0.model.", "mtp.0.head"))}
    for name in ("fn", "base", "scale"):
        mtp[f"mtp.0.hc_head_{name}"] = draft[f"model.hc_head.hc_{name}"]
    generator = torch.Generator().manual_seed(9)
    mtp["mtp.0.norm.weight"] = draft["model.norm.weight"]
    for name in ("e_proj", "h_proj"):
        mtp[f"mtp.0.{name}.weight"] = torch.randn(H, H, generator=generator) * 0.08
    for name in ("enorm", "hnorm"):
        mtp[f"mtp.0.{name}.weight"] = 1 + 0.1 * torch.randn(H, generator=generator)
    file = next(path.glob("*.safetensors"))
    save_file({**load_file(str(file)), **mtp}, str(file), metadata={"format": "pt"})
    torch.save(mtp, root / "draft" / "mtp.pt")
    return path


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight


def test_a_pass_is_deepseeks_formula_over_transformers_layer(checkpoint: Path) -> None:
    """x = e_proj(enorm(embed(t))) + h_proj(hnorm(h)) per stream, g = the layer (transformers'
    `DeepseekV4DecoderLayer` on the same weights, sliding window and sinks, scored experts),
    logits = head(norm(hc_head(g))): dgpp's pass over 12 positions (past the window) equals it."""
    draft_dir = checkpoint.parent / "draft"
    mtp = torch.load(draft_dir / "mtp.pt")
    reference = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    tokens = 12
    h = torch.randn(tokens, STREAMS, H, generator=generator)
    ids = torch.randint(3, 1000, (tokens,), generator=generator)
    with torch.inference_mode():
        embedded = target.model.embed_tokens(ids)
        e = _rms(embedded, mtp["mtp.0.enorm.weight"]) @ mtp["mtp.0.e_proj.weight"].t()
        x = e[:, None] + _rms(h, mtp["mtp.0.hnorm.weight"]) @ mtp["mtp.0.h_proj.weight"].t()
        positions = torch.arange(tokens)[None]
        model = reference.model
        rope = {
            kind: model.rotary_emb(embedded[None], positions, layer_type=kind)
            for kind in ("main", "compress")
        }
        mask = create_sliding_window_causal_mask(
            reference.config, embedded[None], None, None, positions
        )
        g = model.layers[0](
            x[None], position_embeddings=rope, position_ids=positions, attention_mask=mask,
            input_ids=ids[None],
        )[0]  # fmt: skip
        want = target.lm_head(model.norm(model.hc_head(g[None])))[0]

    llm = LLM(str(checkpoint), speculative="mtp", **KNOBS)
    drafting = llm.engine.runner.mtp
    assert drafting is not None
    layout = BatchLayout((BatchRow(0, tokens, [1, 2, 3]),), 0, 4, prefill_softmax_fp32=True)
    metadata = {drafting.backend.name: drafting.backend.prepare(layout)}
    with torch.inference_mode():
        ours = drafting.layer(h, ids, torch.arange(tokens), metadata)
        logits = drafting.layer.compute_logits(ours)[:, : want.shape[-1]]
    torch.testing.assert_close(ours, g, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def _tokens(llm: LLM) -> list[tuple[int, ...]]:
    return [tuple(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY)]


def test_mtp_drafts_change_nothing(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random drafts (mostly rejected), then the oracle's (all accepted, several a step): the
    output is plain decoding's and every block and state slot comes back."""
    plain = _tokens(LLM(str(checkpoint), **KNOBS))
    llm = LLM(str(checkpoint), speculative="mtp", **KNOBS)
    assert _tokens(llm) == plain
    assert llm.engine.stats().counters.spec_decode.drafts > 0
    runner = llm.engine.runner  # the layer read the target's streams, not its normed output
    assert runner.mtp is not None and runner.mtp._hidden is runner.model.model.final_streams
    full = {tuple(p): [*p, *out] for p, out in zip(PROMPTS, plain, strict=True)}
    oracle = LLM(str(checkpoint), speculative="mtp", **KNOBS)
    engine = oracle.engine
    oracle_draft_pass(monkeypatch, engine, full)
    assert _tokens(oracle) == plain
    spec = engine.stats().counters.spec_decode
    assert spec.accepted_tokens == spec.draft_tokens > 2 * spec.drafts
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_the_memory_plan_holds_the_layer(checkpoint: Path) -> None:
    check_mtp_memory_plan(checkpoint, **KNOBS)


def test_world_of_two_drafts_with_its_sharded_layer(checkpoint: Path) -> None:
    """The layer's heads and experts split over two ranks, its keys paged on each: world two
    with MTP drafts gives world one's plain tokens."""
    from tests.engine.distributed.test_tensor_parallel import KNOBS as TP_KNOBS
    from tests.engine.distributed.test_tensor_parallel import _check_world_of_two

    _check_world_of_two(checkpoint, {**TP_KNOBS, "speculative": "mtp"})
