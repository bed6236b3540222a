"""DeepSeek-V4's compressed sparse attention where the indexer's budget drops windows and its
scores tie (issue 62, case 2): two indexer heads leave many windows scoring exactly zero, so
which of them fill the budget's last places decides the output. dgpp takes the lowest-indexed
(`dgpp.kernels.topk_ties`), whatever the row's length; transformers leaves it to `torch.topk`,
whose choice among ties moves with the row's length (its one-shot forward and its cached one
disagree), so the reference here is transformers with its top-k's ties taken in the same order
(a stable descending sort). Against it, at block size 16: prompt logprobs in one chunk and in
16- and 32-token chunks, 16 greedy tokens, teacher-forced logits, and a prefix hit whose
suffix chooses among the cached windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dgpp.engine import LLM, SamplingParams
from dgpp.engine.layers.v4_indexer import LightningIndexer
from dgpp.kernels.topk_ties import topk_earliest
from tests.conftest import build_tiny_checkpoint
from tests.engine.parity import (
    earliest_ties,
    hf_greedy,
    hf_token_logprobs,
    max_logit_difference,
)

SLIDING, SPARSE, HEAVY = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
RATE, BUDGET, NEW, PROMPT = 4, 16, 16, 200  # 50 windows closed by the prompt, 16 attended
CSA_TINY = dict(
    hidden_size=128,
    num_hidden_layers=4,
    layer_types=[SLIDING, SPARSE, HEAVY, SPARSE],
    compress_rates={SPARSE: RATE, HEAVY: 16},
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=16,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    sliding_window=16,
    index_n_heads=2,  # few enough that many windows score exactly zero
    index_head_dim=32,
    index_topk=BUDGET,
    hc_mult=2,
    intermediate_size=64,
    num_hash_layers=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("deepseek-v4-csa")
    return build_tiny_checkpoint(out, tokenizer_dir, "DeepseekV4ForCausalLM", **CSA_TINY)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(3, 49000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def reference(hf_model: torch.nn.Module, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """transformers' prompt logprobs and its 16 greedy tokens (decoded with its cache); and a
    check that the prompt makes the budget drop windows among tied scores."""
    edges: list[int] = []

    def count_ties(module: torch.nn.Module, args: object, score: torch.Tensor) -> None:
        closed = (torch.arange(score.shape[1]) + 1) // RATE
        visible = torch.arange(score.shape[2])[None] < closed[:, None]
        score = score[0].masked_fill(~visible, float("-inf"))
        kth = score.topk(BUDGET, dim=-1).values[:, -1:]
        edges.append(int(((score == kth).sum(-1) > 1)[closed > BUDGET].sum()))

    scorers = [m for m in hf_model.modules() if type(m).__name__ == "DeepseekV4IndexerScorer"]
    hooks = [scorer.register_forward_hook(count_ties) for scorer in scorers]
    try:
        logprobs = hf_token_logprobs(hf_model, prompt)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(edges) == 2 and min(edges) > 10, edges  # both sparse layers, many tied edges
    with earliest_ties():
        return logprobs, hf_greedy(hf_model, prompt, NEW)


def test_ties_at_the_budgets_edge_go_to_the_lowest_index() -> None:
    """The same scores give the same choice however many keys (out of reach, -inf) follow
    them: the first of a stable descending sort."""
    generator = torch.Generator().manual_seed(3)
    score = torch.randn(64, 40, generator=generator).clamp(max=0.0)  # half the keys tie at 0
    score[::2] = score[::2].neg()  # and rows whose ties are all below the budget
    want = torch.sort(score, descending=True, stable=True).indices[:, :BUDGET]
    indexer = LightningIndexer(8, 8, 1, 4, RATE, BUDGET, 1e-6)
    positions = torch.full((64,), 40 * RATE - 1)
    for pad in (0, 1, 10, 24, 200):
        padded = torch.cat((score, torch.full((64, pad), float("-inf"))), dim=1)
        got = indexer.select(padded, positions)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values), pad
    assert torch.equal(topk_earliest(score, 40), torch.arange(40).expand(64, 40))  # all of it


@pytest.mark.parametrize("chunk", [512, 32, 16])
def test_prompt_logprobs_greedy_and_logits_match_transformers(
    checkpoint: Path,
    hf_model: torch.nn.Module,
    prompt: list[int],
    reference: tuple[torch.Tensor, list[int]],
    chunk: int,
) -> None:
    want, tokens = reference
    llm = LLM(str(checkpoint), dtype="float32", block_size=16, prefill_chunk_tokens=chunk, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, prompt_logprobs=0)
    output = llm.generate([prompt], params)[0]
    assert output.prompt_logprobs is not None
    got = torch.tensor([scored.logprob for scored in output.prompt_logprobs[1:]])
    worst = (got - want).abs()
    assert worst.max() < 1e-3, (worst.max().item(), int(worst.argmax()) + 1)
    assert list(output.outputs[0].token_ids) == tokens
    with earliest_ties():
        assert max_logit_difference(llm, hf_model, prompt, tokens) < 1e-3


def test_a_prefix_hit_restores_the_windows_the_indexer_chooses_from(
    checkpoint: Path, hf_model: torch.nn.Module, prompt: list[int]
) -> None:
    """A conversation's next turn restores the first turn's 112 tokens (28 windows, more than
    the budget); the rest of the prompt chooses among them in 32-token chunks and decodes,
    each sampled token's logprob within 1e-3 of transformers'."""
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        block_size=16,
        prefill_chunk_tokens=32,
        prefix_min_tokens=16,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    first = prompt[:120]
    reply = list(llm.generate([first], params)[0].outputs[0].token_ids)
    turn = first + reply + prompt[136:]
    output = llm.generate([turn], params)[0].outputs[0]
    assert llm.engine.counters.prefix_cache.hit_tokens == 112
    with earliest_ties():
        assert list(output.token_ids) == hf_greedy(hf_model, turn, NEW)
    want = hf_token_logprobs(hf_model, turn + list(output.token_ids))[len(turn) - 1 :]
    assert output.logprobs is not None
    got = torch.tensor([scored.logprob for scored in output.logprobs])
    assert (got - want).abs().max() < 1e-3
