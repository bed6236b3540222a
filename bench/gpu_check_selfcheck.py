"""Section (s) of the GPU check: the start-up self-check (`dgpp.engine.selfcheck`) at real
checkpoints' per-rank shapes (their config.json from appliance/checkpoint_facts; random inputs,
no weights): the attention kernels, RMSNorm, SiLU-and-mul and the fused MoE over 8 experts of
the real width, in bfloat16 (float32 and tiny shapes under `--dry-run`). Per family: the cases
and their outcome, the first start's seconds (Triton compiles each kernel) and a restart's
(every result read from the cache)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.models.moe_config import gpt_oss_moe_spec, grouped_moe_spec, qwen3_moe_spec
from dgpp.engine.selfcheck.attention_cases import attention_cases
from dgpp.engine.selfcheck.results_cache import ResultsCache
from dgpp.engine.selfcheck.run import self_check
from dgpp.engine.selfcheck.weight_cases import moe_cases, norm_cases, silu_case
from dgpp.kernels import dispatch

FACTS = Path(__file__).resolve().parents[1] / "appliance" / "checkpoint_facts"
# (checkpoint, tensor-parallel ranks as its templates deploy it, its MoE spec reader)
FAMILIES = (
    ("meta-llama--Llama-3.1-8B-Instruct", 1, None),
    ("Qwen--Qwen3-30B-A3B", 1, qwen3_moe_spec),
    ("openai--gpt-oss-120b", 1, gpt_oss_moe_spec),
    ("zai-org--GLM-4.5-Air", 2, grouped_moe_spec),
    ("deepseek-ai--DeepSeek-V3-0324", 4, grouped_moe_spec),
)
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4)


def _cases(raw: dict, tp: int, reader: object, dtype: torch.dtype, device: torch.device) -> list:
    model = ModelConfig.from_dict(raw)
    parallel = ParallelContext(0, tp)
    cases = attention_cases(model, parallel, 16, dtype, True, device)
    cases += norm_cases(model.hidden_size, dtype, device)
    cases.append(silu_case(model.intermediate_size // tp, dtype, device))
    if reader is not None:
        spec = reader(raw)
        inner, hidden = spec.intermediate_size // tp, model.hidden_size
        gen = torch.Generator(device=device).manual_seed(9)
        experts = SimpleNamespace(
            num_experts=8,
            spec=spec,
            gate_up_proj=torch.randn(8, 2 * inner, hidden, generator=gen, device=device)
            / hidden**0.5,
            down_proj=torch.randn(8, hidden, inner, generator=gen, device=device) / inner**0.5,
            gate_up_proj_bias=torch.randn(8, 2 * inner, generator=gen, device=device)
            if spec.expert_bias
            else None,
        )
        cases += moe_cases(experts, dtype, device)  # type: ignore[arg-type]
    return cases


def selfcheck_section(device: torch.device, dry_run: bool) -> list[dict]:
    dtype = torch.float32 if dry_run else torch.bfloat16
    rows = []
    for name, tp, reader in FAMILIES[:2] if dry_run else FAMILIES:
        raw = json.loads((FACTS / f"{name}.json").read_text())
        if dry_run:
            raw = {**raw, **TINY, "num_key_value_heads": 2, "head_dim": 16}
        cache = ResultsCache(Path(tempfile.mkdtemp(prefix="selfcheck-")))
        timings = []
        for _ in range(2):  # a first start, then a restart on the cache
            dispatch.restore_kernels()
            started = time.perf_counter()
            states, results = self_check(
                _cases(raw, tp, reader, dtype, device), device, cache, False
            )
            timings.append(time.perf_counter() - started)
        dispatch.restore_kernels()
        rows.append({
            "model": name, "tp": tp, "dtype": str(dtype)[6:], "cases": len(results),
            "kernels": states, "first_start_s": timings[0], "cached_start_s": timings[1],
            "failures": [r.to_json() for r in results if not r.ok],
        })  # fmt: skip
    return rows
