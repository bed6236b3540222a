"""lm-evaluation-harness against `dgpp serve` (issue 44): its own command line, unmodified, runs a
multiple-choice task and a rolling-perplexity task defined from local files (no hub download)
through its `local-completions` model (`echo`, `logprobs`, `max_tokens: 1` over token ids);
every logged log-likelihood equals the one transformers gives on the same weights (float32)
for the same tokens, and so do the accuracy and the perplexity it reports."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import build_tiny_checkpoint
from tests.engine.server.harness import running_server

pytest.importorskip("lm_eval")

DOCS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["five", "four", "a fox"], "answer": 1},
    {"question": "Water freezes when it is", "choices": ["hot", "dry", "cold"], "answer": 2},
    {"question": "A cat says", "choices": ["meow", "woof", "moo"], "answer": 0},
]
TEXTS = [
    {"text": "The fox ran across the field at dawn and the dog followed it to the river."},
    {"text": "Neither moved until the sun was high; then both went home."},
]
TASKS = {
    "dgpp_choice": """task: dgpp_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "dgpp_rolling": """task: dgpp_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/rolling.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("lm-eval-model")
    return build_tiny_checkpoint(out, tokenizer_dir, "Qwen3ForCausalLM")


def _write_tasks(folder: Path) -> None:
    for name, rows in (("choice", DOCS), ("rolling", TEXTS)):
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (folder / f"{name}.jsonl").write_text(lines)
    for task, text in TASKS.items():
        (folder / f"{task}.yaml").write_text(text.format(dir=folder))


class Reference:
    """Log-likelihoods from transformers, over the tokens lm-eval's `_encode_pair` sends."""

    def __init__(self, checkpoint: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def loglikelihood(self, context: list[int], continuation: list[int]) -> float:
        ids = context + continuation
        with torch.inference_mode():
            logprobs = self.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        start = len(context)
        return sum(logprobs[p - 1, ids[p]].item() for p in range(start, len(ids)))

    def choice(self, context: str, continuation: str) -> float:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.encode(context + continuation), self.encode(context)
        return self.loglikelihood(head, whole[len(head) :])

    def rolling(self, text: str) -> float:
        """One window (the texts are short), after lm-eval's prefix token: BOS, else EOS."""
        prefix = self.tokenizer.bos_token_id
        prefix = self.tokenizer.eos_token_id if prefix is None else prefix
        return self.loglikelihood([prefix], self.encode(text))


def _samples(out: Path, task: str) -> list[dict]:
    (found,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in found.read_text().splitlines()]


def test_lm_eval_scores_equal_transformers(checkpoint: Path, tmp_path: Path) -> None:
    _write_tasks(tmp_path)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "HF_HOME": str(tmp_path / "hf"),
    }
    with running_server(checkpoint, ("m",), {"kv_capacity": 2048, "block_size": 4}) as server:
        model_args = (
            f"model=m,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={checkpoint},num_concurrent=1,max_retries=1,max_length=512"
        )
        command = [sys.executable, "-m", "lm_eval", "--model", "local-completions"]
        command += ["--model_args", model_args, "--tasks", "dgpp_choice,dgpp_rolling"]
        command += ["--include_path", str(tmp_path), "--output_path", str(out)]
        command += ["--log_samples", "--batch_size", "1"]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    reference = Reference(checkpoint)
    correct = 0
    for sample in _samples(out, "dgpp_choice"):
        doc = sample["doc"]
        want = [reference.choice(doc["question"], " " + c) for c in doc["choices"]]
        got = [float(resp[0][0]) for resp in sample["resps"]]  # logged as text
        assert got == pytest.approx(want, abs=1e-4)
        correct += int(max(range(len(want)), key=want.__getitem__) == doc["answer"])
    words = nll = 0.0
    for sample in _samples(out, "dgpp_rolling"):
        text = sample["doc"]["text"]
        want_ll = reference.rolling(text)
        assert float(sample["resps"][0][0]) == pytest.approx(want_ll, abs=1e-4)
        words += len(text.split())
        nll -= want_ll
    (results,) = out.rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]
    assert scores["dgpp_choice"]["acc,none"] == pytest.approx(correct / len(DOCS))
    perplexity = scores["dgpp_rolling"]["word_perplexity,none"]
    assert perplexity == pytest.approx(math.exp(nll / words), rel=1e-4)
