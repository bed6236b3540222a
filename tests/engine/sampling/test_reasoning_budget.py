"""A cap on reasoning tokens: the closing sequence is forced once the budget is spent, and only
then (real engine on a tiny random-weight model; Anthropic `thinking.budget_tokens` over HTTP
on the default model behind a template that opens the reasoning block)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

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
    for token in (1, 2):
        assert budget.forced() is None
        budget.advance(token)
    assert budget.forced() == 7
    budget.advance(7)
    assert budget.forced() == 8
    budget.advance(8)
    assert budget.closed and budget.forced() is None
    early = ReasoningBudget(5, (7, 8))
    for token in (1, 7, 7, 8):  # closed by the model itself, a false start included
        early.advance(token)
    assert early.closed and early.forced(6) is None
    # An output that opens the block itself (<think> = 5), a harmony-style close: the model's
    # own `<|end|>` (7) closes it; past the budget the whole end sequence is forced.
    harmony = ReasoningBudget(2, (7, 8, 9), opens=(4, 5), closes=(7,))
    for token in (1, 4, 4, 5):  # not counted before the block opens
        assert harmony.forced() is None
        harmony.advance(token)
    assert harmony.is_open and harmony.spent == 0
    harmony.advance(7)  # the model's own close
    assert harmony.closed
    forced = ReasoningBudget(1, (7, 8, 9), opens=(5,), closes=(7,))
    drawn = []
    for token in (5, 1, 0, 0, 0, 2):  # what the model would draw; forced where it may not
        token = forced.forced() if forced.forced() is not None else token
        drawn.append(token)
        forced.advance(token)
    assert drawn == [5, 1, 7, 8, 9, 2] and forced.closed
    never = ReasoningBudget(0, (7,), opens=(5,))
    for token in (1, 2, 3):  # a final answer with no reasoning: nothing forced
        assert never.forced() is None
        never.advance(token)
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


def test_an_output_that_opens_the_block_itself_is_capped_from_there(tiny: LLM) -> None:
    """`<think>` written by the model (DeepSeek-R1, GLM without a prompt-opened block) or
    gpt-oss's analysis channel: the budget counts from the opening, and a harmony-style end
    (longer than the model's own close) is forced whole."""
    prompt = "Think about it:"
    free = tiny.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    tokens = free.outputs[0].token_ids
    opens = (tokens[1],)  # the block opens at the second token
    end = tuple(tiny.tokenizer("</end><final>", add_special_tokens=False).input_ids)
    assert end[0] not in tokens[:6]  # the model would not close it
    params = SamplingParams(
        max_tokens=16, temperature=0, reasoning_budget=3, reasoning_end=end,
        reasoning_open=opens, reasoning_close=end[:1],
    )  # fmt: skip
    got = tiny.generate([prompt], params)[0].outputs[0].token_ids
    assert got[:5] == tokens[:5]  # two tokens to open it, then three of reasoning
    assert tuple(got[5 : 5 + len(end)]) == end


def _chat_effort(server: RunningServer, **fields: object) -> dict:
    body = {
        "model": "think",
        "temperature": 0,
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        **fields,
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_reasoning_effort_and_max_tokens_leave_the_answer_room(
    thinking_server: RunningServer,
) -> None:
    """The default model never closes `<think>` by itself: OpenAI's `reasoning_effort: low`
    with a small `max_tokens`, or no effort at all, still ends with a non-empty answer (three
    quarters of max_tokens at most for reasoning); `minimal` caps at its own 256 tokens first,
    which here is more than the cap (no change); the Responses API's `reasoning.effort` too."""
    tokenizer = thinking_server.state.tokenizer
    for fields in ({"reasoning_effort": "low"}, {}):
        body = _chat_effort(thinking_server, max_tokens=40, **fields)
        message = body["choices"][0]["message"]
        reasoning = tokenizer(message["reasoning_content"], add_special_tokens=False).input_ids
        assert 0 < len(reasoning) <= 30 and message["content"].strip(), message
    none = _chat_effort(thinking_server, max_tokens=40, reasoning_effort="none")
    assert none["choices"][0]["message"]["content"].strip()
    assert not none["choices"][0]["message"].get("reasoning_content")
    body = {
        "model": "think", "temperature": 0, "input": "Why is the sky blue?",
        "max_output_tokens": 40, "reasoning": {"effort": "low"},
    }  # fmt: skip
    response = httpx.post(f"{thinking_server.url}/v1/responses", json=body, timeout=120).json()
    kinds = [item["type"] for item in response["output"]]
    assert kinds[0] == "reasoning" and "message" in kinds, kinds
    text = next(i for i in response["output"] if i["type"] == "message")["content"][0]["text"]
    assert text.strip()


def test_harmony_and_think_markers_are_the_formats_own(thinking_server: RunningServer) -> None:
    """gpt-oss closes analysis with `<|end|>` and is sent to the final channel; a template
    with `<think>` whose prompt did not open it waits for the model's `<think>`."""
    from dgpp.engine.server.pipeline.thinking_budget import HARMONY_END, HARMONY_OPEN, markers
    from dgpp.engine.server.tool_formats.output_format import choose_output_format

    state = thinking_server.state
    parser = SimpleNamespace(starts_in_reasoning=False, forced=None)
    opens, end, close = markers(state, parser)  # type: ignore[arg-type,misc]
    ids = state.tokenizer
    assert opens == tuple(ids("<think>", add_special_tokens=False).input_ids)
    assert end == tuple(ids("</think>", add_special_tokens=False).input_ids) and close == ()
    harmony = SimpleNamespace(
        tokenizer=state.tokenizer,
        output_format=choose_output_format("harmony", state.tokenizer),
    )
    opens, end, close = markers(harmony, parser)  # type: ignore[arg-type,misc]
    assert opens == tuple(ids(HARMONY_OPEN, add_special_tokens=False).input_ids)
    assert end == tuple(ids(HARMONY_END, add_special_tokens=False).input_ids)
    assert close == tuple(ids("<|end|>", add_special_tokens=False).input_ids)


def test_a_forced_close_is_followed_by_an_answer_before_the_end_token(tiny: LLM) -> None:
    """A model that would end right after the forced close (its end token biased to the top)
    writes an answer first: the end token is masked until the answer has text, then allowed."""
    end = tuple(tiny.tokenizer("</think>", add_special_tokens=False).input_ids)
    eos = tiny.engine.eos_token_ids
    (stop,) = sorted(eos)[:1]
    biased = {"max_tokens": 12, "temperature": 0, "logit_bias": {stop: 100.0}}
    params = SamplingParams(**biased, reasoning_budget=0, reasoning_end=end)
    output = tiny.generate(["Think about it:"], params)[0].outputs[0]
    tokens = output.token_ids
    assert tuple(tokens[: len(end)]) == end  # closed at once (a budget of 0)
    answer = tokens[len(end) :]
    assert tiny.tokenizer.decode(answer[:-1]).strip() and answer[-1] in eos, output
    assert output.finish_reason == "stop"
    unbudgeted = tiny.generate(["Think about it:"], SamplingParams(**biased))[0].outputs[0]
    assert len(unbudgeted.token_ids) == 1  # the bias alone: the end at once


def test_the_output_does_not_end_inside_the_reasoning_block(tiny: LLM) -> None:
    """A model that would end while thinking (its end token biased up) thinks on to the
    budget's close and answers."""
    end = tuple(tiny.tokenizer("</think>", add_special_tokens=False).input_ids)
    (stop,) = sorted(tiny.engine.eos_token_ids)[:1]
    biased = {"max_tokens": 16, "temperature": 0, "logit_bias": {stop: 100.0}}
    params = SamplingParams(**biased, reasoning_budget=4, reasoning_end=end)
    tokens = tiny.generate(["Think about it:"], params)[0].outputs[0].token_ids
    assert stop not in tokens[:4] and tuple(tokens[4 : 4 + len(end)]) == end
    assert tiny.tokenizer.decode(tokens[4 + len(end) : -1]).strip() and tokens[-1] == stop
