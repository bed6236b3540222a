"""`speculative: mtp` on the hybrid families, tiny Qwen3-Next, Qwen3.5 and Qwen3.5-MoE with their
`mtp.*` layer: the layer's step equals a reference written from the equations in this test, with
transformers' own full-attention decoder layer, zero-centred RMSNorm and rotary embedding; its
drafts (random, so mostly rejected; or an oracle's, right up to a varying depth) leave the output
plain decoding's, cold, under preemption and through prefix hits that restore a state snapshot;
a world of two drafts with the sharded layer; the memory plan counts it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dgpp.engine import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint
from tests.engine.speculative.mtp_checkpoint import (
    QWEN_FAMILIES,
    qwen_class,
    qwen_mtp_block,
    stacked,
    with_qwen_mtp_layer,
)
from tests.engine.speculative.mtp_checks import check_mtp_memory_plan, mtp_step, oracle_draft_pass

PROMPTS = [[5, 17, 99, 3, 42], list(range(100, 137)), [7, 8, 9] * 6]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
KNOBS = dict(kv_capacity=512, block_size=4, prefill_chunk_tokens=16, prefix_min_tokens=8)


@pytest.fixture(scope="module", params=sorted(QWEN_FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, family: str
) -> tuple[Path, dict[str, torch.Tensor], object]:
    architecture, overrides, _, _, _ = QWEN_FAMILIES[family]
    out = tmp_path_factory.mktemp(f"{family}-mtp")
    path = build_tiny_checkpoint(out, tokenizer_dir, architecture, **overrides)
    tensors, config = with_qwen_mtp_layer(path, family)
    return path, tensors, config


@pytest.fixture(scope="module")
def checkpoint(built: tuple[Path, dict[str, torch.Tensor], object]) -> Path:
    return built[0]


def _reference(family: str, mtp: dict, config: object, embed, head, h, next_ids):
    """The MTP step for one sequence of positions 0 .. T-1, causal:
    x = fc([norm_e(Emb(t_{i+1})); norm_h(h_i)]), g = block(x), logits = LMHead(norm(g))."""
    block = qwen_mtp_block(family, config).eval()
    own = {k[len("layers.0.") :]: v for k, v in mtp.items() if k.startswith("layers.0.")}
    if not QWEN_FAMILIES[family][4]:
        own = stacked(own)
    block.load_state_dict(own)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        norm = qwen_class(family, "RMSNorm")(x.shape[-1], eps=config.rms_norm_eps)
        norm.weight.data.copy_(weight)
        return norm(x)

    emb = rms(embed[next_ids], mtp["pre_fc_norm_embedding.weight"])
    x = torch.cat((emb, rms(h, mtp["pre_fc_norm_hidden.weight"])), -1) @ mtp["fc.weight"].T
    tokens = x.shape[0]
    positions = torch.arange(tokens)[None]
    cos_sin = qwen_class(family, "RotaryEmbedding")(config)(x[None], positions)
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]
    with torch.inference_mode():
        g = block(x[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
    g = (g[0] if isinstance(g, tuple) else g)[0]
    return g, rms(g, mtp["norm.weight"]) @ head.T


def test_the_mtp_layer_is_the_reference_step(built: tuple, family: str) -> None:
    checkpoint, mtp_tensors, config = built
    step = mtp_step(checkpoint, config)  # every parameter from `mtp.*`
    assert not hasattr(step.layer, "shared_head")  # the target's LM head serves
    embed = step.target.model.embed_tokens.weight.detach()
    head = step.target.lm_head.weight.detach()[: config.vocab_size]
    ref_g, ref_logits = _reference(family, mtp_tensors, config, embed, head, step.h, step.next_ids)
    torch.testing.assert_close(step.g, ref_g, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step.logits, ref_logits, rtol=1e-4, atol=1e-4)


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[tuple[int, ...]]:
    return [tuple(out.outputs[0].token_ids) for out in llm.generate(prompts, GREEDY)]


def test_random_mtp_drafts_change_nothing(checkpoint: Path) -> None:
    plain = _tokens(LLM(str(checkpoint), prefix_cache=False, **KNOBS))
    llm = LLM(str(checkpoint), speculative="mtp", **KNOBS)
    assert _tokens(llm) == plain
    engine = llm.engine
    assert engine.counters.spec_decode.drafts > 0
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    states = engine.block_manager.states
    assert states is not None and states.slots.num_free == engine.config.max_concurrency


@pytest.mark.parametrize("pool", [56, 1024], ids=["preempting", "prefix-hits"])
def test_partly_right_drafts_change_nothing(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, pool: int
) -> None:
    """Verify rows accept a varying number of the MTP drafts (their states rolled back to the
    last accepted one), beside preemption, or followed by a second turn that restores the
    snapshot at its prompt's last block."""
    knobs = {**KNOBS, "kv_capacity": pool}
    plain_llm = LLM(str(checkpoint), prefix_cache=False, **knobs)
    plain = _tokens(plain_llm)
    full = {tuple(p): [*p, *out] for p, out in zip(PROMPTS, plain, strict=True)}
    turn_two = [*full[tuple(PROMPTS[1])], 7, 8, 9]
    if pool == 1024:
        again = _tokens(plain_llm, [turn_two])[0]
        full[tuple(turn_two)] = [*turn_two, *again]
    llm = LLM(str(checkpoint), speculative="mtp", **knobs)
    engine = llm.engine
    oracle_draft_pass(monkeypatch, engine, full, wrong=True)
    assert _tokens(llm) == plain
    spec = engine.counters.spec_decode
    assert 0 < spec.accepted_tokens < spec.draft_tokens
    assert (engine.counters.num_preemptions > 0) == (pool == 56)
    if pool == 1024:
        assert _tokens(llm, [turn_two])[0] == again
        states = engine.block_manager.states
        assert states is not None and states.snapshots.stats().hits >= 1
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_world_of_two_drafts_with_its_sharded_mtp_layer(checkpoint: Path) -> None:
    from tests.engine.distributed.test_tensor_parallel import KNOBS as TP_KNOBS
    from tests.engine.distributed.test_tensor_parallel import _check_world_of_two

    _check_world_of_two(checkpoint, {**TP_KNOBS, "speculative": "mtp"})


def test_the_memory_plan_counts_the_mtp_layer(checkpoint: Path) -> None:
    """Its KV pool (one more full-attention layer's), its weights (the LM head not twice) and
    the draft slots of the recurrent states."""
    llm, plan, plain = check_mtp_memory_plan(checkpoint, **KNOBS)
    engine, runner = llm.engine, llm.engine.runner
    assert plan.state_bytes == sum(pool.nbytes for pool in runner.state_pools)
    layout = runner.state_layout
    drafts = layout.slot_bytes * engine.config.max_concurrency * engine.config.spec_depth
    assert plan.state_bytes - plain.state_bytes == drafts


def test_structured_outputs_are_unchanged(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a JSON-schema grammar (the masks apply to every verified position), partly right
    drafts leave the constrained output plain decoding's."""
    from dgpp.engine.sampling.grammar import json_schema_grammar
    from tests.engine.sampling.test_grammar import LIST

    params = SamplingParams(max_tokens=40, temperature=0, grammar=json_schema_grammar(LIST, "s"))
    plain = LLM(str(checkpoint), prefix_cache=False, **KNOBS)
    expected = [tuple(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, params)]
    assert all(plain.tokenizer.decode(list(t)).startswith("{") for t in expected)
    llm = LLM(str(checkpoint), speculative="mtp", **KNOBS)
    full = {tuple(p): [*p, *t] for p, t in zip(PROMPTS, expected, strict=True)}
    oracle_draft_pass(monkeypatch, llm.engine, full, wrong=True)
    assert [tuple(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)] == expected
    spec = llm.engine.counters.spec_decode
    assert 0 < spec.accepted_tokens < spec.draft_tokens
