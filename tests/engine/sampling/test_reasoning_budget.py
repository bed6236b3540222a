"""A cap on reasoning tokens: the closing sequence is forced once the budget is spent, and only
then (real engine on a tiny random-weight model; Anthropic `thinking.budget_tokens` over HTTP
on the default model behind a template that opens the reasoning block)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from dgpp.engine.errors import InvalidRequestError
from dgpp.engine.llm import LLM
from dgpp.engine.sampling.reasoning_budget import ReasoningBudget, force_rows
from dgpp.engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_tiny_checkpoint
from tests.engine.server.conftest import DEFAULT_ENGINE
from tests.engine.server.harness import RunningServer, linked_checkpoint, running_server

THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def test_the_budget_forces_the_closing_sequence_once() -> None:
    budget = ReasoningBudget(2, (7, 8))
    assert [budget.forced(n) for n in (0, 1)] == [None, None]
    assert budget.forced(2) == 7
    budget.advance(7)
    assert budget.forced(3) == 8
    budget.advance(8)
    assert budget.closed and budget.forced(9) is None
    early = ReasoningBudget(5, (7, 8))
    for token in (1, 7, 7, 8):  # closed by the model itself, a false start included
        early.advance(token)
    assert early.closed and early.forced(6) is None
    logits = torch.zeros(2, 10)
    force_rows(logits, [None, 3])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[1]).nonzero().tolist() == [[3]]
    with pytest.raises(InvalidRequestError):
        SamplingParams(reasoning_budget=3)  # no closing ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> LLM:
    checkpoint = build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny"), tokenizer_dir, "LlamaForCausalLM"
    )
    return LLM(str(checkpoint), kv_capacity=512, block_size=4)


@pytest.mark.parametrize("budget", [0, 3, 6])
def test_the_engine_closes_the_block_after_the_budget(tiny: LLM, budget: int) -> None:
    end = tuple(tiny.tokenizer("</think>", add_special_tokens=False).input_ids)
    prompt = "Think about it:"
    free = tiny.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    assert end[0] not in free.outputs[0].token_ids[: budget + 1]  # the model would not close it
    params = SamplingParams(
        max_tokens=16, temperature=0, reasoning_budget=budget, reasoning_end=end
    )
    tokens = tiny.generate([prompt], params)[0].outputs[0].token_ids
    assert tuple(tokens[budget : budget + len(end)]) == end
    assert tokens[:budget] == free.outputs[0].token_ids[:budget]  # free until then


@pytest.fixture(scope="module")
def thinking_server(
    default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    folder = linked_checkpoint(
        default_checkpoint, tmp_path_factory.mktemp("think"), THINKING_TEMPLATE
    )
    with running_server(folder, ("think",), DEFAULT_ENGINE) as server:
        yield server


def test_budget_tokens_caps_the_thinking_block(thinking_server: RunningServer) -> None:
    body = {
        "model": "think",
        "max_tokens": 40,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "thinking": {"type": "enabled", "budget_tokens": 5},
    }
    response = httpx.post(f"{thinking_server.url}/v1/messages", json=body, timeout=120)
    assert response.status_code == 200, response.text
    blocks = {b["type"]: b for b in response.json()["content"]}
    thinking = blocks["thinking"]["thinking"]
    tokenizer = thinking_server.state.tokenizer
    assert 0 < len(tokenizer(thinking.strip(), add_special_tokens=False).input_ids) <= 6
    unbounded = httpx.post(
        f"{thinking_server.url}/v1/messages",
        json={**body, "thinking": {"type": "enabled"}},
        timeout=120,
    ).json()
    (free,) = [b["thinking"] for b in unbounded["content"] if b["type"] == "thinking"]
    assert len(free) > len(thinking)  # the default model reasons on without a budget
