"""The engine runs where only PyTorch, Triton and transformers are installed (the GPU check's
image: no FastAPI, llguidance, gguf or fla-core): a tiny Llama checkpoint served offline, greedy,
in a process where importing any of those fails, gives the tokens it gives here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dgpp.engine import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint

ABSENT = ("gguf", "fastapi", "starlette", "uvicorn", "llguidance", "fla")
PROMPT = [1, 504, 3458, 282, 4649, 314]

RUN = """
import importlib.abc, json, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent here)")

sys.meta_path.insert(0, Absent())
from dgpp.engine import LLM, SamplingParams

llm = LLM({checkpoint!r}, kv_capacity=256, block_size=8)
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
out = llm.generate([{prompt!r}], params)[0].outputs[0]
print(json.dumps(list(out.token_ids)))
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in {absent!r})))
"""


def test_an_engine_serves_without_the_server_and_gguf_packages(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", tokenizer_dir, "LlamaForCausalLM")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(checkpoint), kv_capacity=256, block_size=8)
    expected = list(llm.generate([PROMPT], params)[0].outputs[0].token_ids)
    code = RUN.format(absent=set(ABSENT), checkpoint=str(checkpoint), prompt=PROMPT)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tokens, imported = (json.loads(line) for line in result.stdout.strip().splitlines()[-2:])
    assert tokens == expected
    assert imported == []
