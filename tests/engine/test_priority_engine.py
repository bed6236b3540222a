"""Priority on a real engine: an urgent request arriving while background streams hold every
slot displaces the newest of them; the displaced stream's computed blocks stay in the prefix
cache and go down to the host tier while the urgent one runs, come back as a host-tier hit, and
every stream ends with the tokens it has alone (greedy, float32 tiny Llama)."""

from __future__ import annotations

from pathlib import Path

from dgpp.engine import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint


def _greedy(priority: int, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, priority=priority
    )


def test_a_displaced_stream_comes_back_through_the_host_tier_with_its_tokens(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path, tokenizer_dir, "LlamaForCausalLM")
    background = [list(range(100 + 50 * i, 140 + 50 * i)) for i in range(2)]  # 40 tokens each
    urgent = list(range(600, 660))  # 60: evicts the displaced stream's cached blocks
    alone = LLM(str(checkpoint), dtype="float32", block_size=4, prefix_cache=False)
    want = [list(o.outputs[0].token_ids) for o in alone.generate([*background, urgent], _greedy(0))]
    llm = LLM(
        str(checkpoint), dtype="float32", block_size=4, kv_capacity=128, max_concurrency=2,
        prefix_min_tokens=4, prefix_cache_host_gib=0.01, max_model_len=80,
    )  # fmt: skip
    engine = llm.engine
    for index, prompt in enumerate(background):
        engine.add_request(prompt, _greedy(10), request_id=f"bg{index}")
    got: dict[str, list[int]] = {}

    def step() -> None:
        for output in engine.step():
            if output.finished:
                got[output.request_id] = list(output.outputs[0].token_ids)

    for _ in range(4):  # both prompts computed, a few tokens each
        step()
    engine.add_request(urgent, _greedy(0), request_id="urgent")
    step()
    running = [request.request_id for request in engine.scheduler.running]
    assert running == ["urgent", "bg0"], running  # bg1, the newest, gave up its slot
    while engine.has_unfinished():
        step()
    assert [got["bg0"], got["bg1"], got["urgent"]] == want
    counters = engine.stats().counters
    assert counters.num_preemptions == 1
    assert counters.prefix_cache.host_spilled_blocks > 0
    assert counters.prefix_cache.host_loaded_blocks > 0  # bg1's blocks, back from the host tier
