"""What each KV-cache dtype gives a deployment, from real checkpoints' facts on Spark memory
(`dgpp deploy plan`): tokens per GiB at int8 and fp8 about twice a bfloat16 cache's, at int4
3.5 times; MLA latents less (their rope key stays 16-bit); more sessions of the configured
context; and for a cache that cannot take a dtype (int4 of an odd width), the reason
instead of numbers."""

from __future__ import annotations

import contextlib
import io

from dgpp.appliance import cli
from dgpp.appliance.common.exit_codes import EXIT_OK
from dgpp.appliance.deployments.deployment import parse_deployment
from dgpp.appliance.deployments.files import find_template
from dgpp.appliance.deployments.kv_dtypes import kv_dtype_rows
from dgpp.appliance.deployments.plan import (
    model_config_of,
    resolve_deployment,
    spark_memory,
)


def _rows(name: str, facts: dict | None = None, **engine: object) -> dict:
    raw = find_template(name).load()
    raw["engine"].update(engine)
    deployment = parse_deployment(raw, name)
    model, _ = model_config_of(deployment)
    model.raw.update(facts or {})
    memory = spark_memory()
    resolved = resolve_deployment(deployment, model, memory)
    return {row.kv_dtype: row for row in kv_dtype_rows(resolved, memory, lambda config: 0)}


def test_quantized_dtypes_hold_about_twice_the_tokens_per_gib() -> None:
    rows = _rows("llama-3.1-8b-instruct_bfloat16_w1", device="cpu")
    auto = rows["auto"].tokens_per_gib
    assert rows["auto"].bytes_per_token == 2 * 32 * 8 * 128 * 2  # layers, K+V, heads, dim, bf16
    assert rows["int8"].tokens_per_gib >= 1.88 * auto  # Q8_0 blocks: 34 bytes per 32
    assert rows["fp8_e4m3"].tokens_per_gib >= 1.9 * auto  # one scale per head: 130 per 128
    assert rows["int4"].tokens_per_gib >= 3.5 * auto  # Q4_0: 18 per 32
    assert rows["int8"].sessions > 1.8 * rows["auto"].sessions


def test_latent_caches_keep_the_rope_key_and_still_gain() -> None:
    """Kimi-Linear on two Sparks (MLA beside KDA states): a latent row is 512 values in blocks
    and the 64-value rope key in bfloat16, so int8 gives 1152 / 672 = 1.71x the tokens, fp8
    1152 / 656 = 1.76x (FlashMLA's layout), int4 1152 / 416 = 2.77x; the states are as they
    are."""
    rows = _rows("kimi-linear-48b-a3b-instruct_bfloat16_w2")
    auto = rows["auto"]
    assert not any(row.refused for row in rows.values())
    layers = auto.bytes_per_token // 1152
    assert auto.bytes_per_token == layers * 1152
    for kv, width in (("int8", 672), ("fp8_e4m3", 656), ("int4", 416)):
        assert rows[kv].bytes_per_token == layers * width
        assert rows[kv].tokens_per_gib >= 1152 / width * 0.99 * auto.tokens_per_gib
        assert rows[kv].sessions >= auto.sessions


def test_refusals_say_why() -> None:
    rows = _rows("llama-3.1-8b-instruct_bfloat16_w1")  # cuda: the Triton kernels read them
    assert not any(row.refused for row in rows.values())
    rows = _rows("deepseek-v4-flash_bfloat16_w2", device="cpu")  # compressed keys
    assert not any(row.refused for row in rows.values())
    assert rows["int8"].tokens_per_gib > 1.5 * rows["auto"].tokens_per_gib
    rows = _rows("kimi-linear-48b-a3b-instruct_bfloat16_w2", {"kv_lora_rank": 511})
    assert "int4 KV needs an even head dimension" in rows["int4"].refused
    assert "values that work: auto, int8, fp8_e4m3" in rows["int4"].refused
    assert not rows["int8"].refused


def test_deploy_plan_prints_every_dtype() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["deploy", "plan", "--template", "smollm2-135m_float32_w1"])
    assert code == EXIT_OK
    text = out.getvalue()
    assert "| KV dtype | bytes/token | tokens per GiB" in text
    assert all(f"| {kv} | " in text for kv in ("auto", "int8", "fp8_e4m3", "int4"))
