"""Memory plans of the shipped templates on DGX Spark memory, from the facts of their real
checkpoints: weights, KV bytes per token, the largest context, and a refusal that names the
numbers when a world does not fit."""

from __future__ import annotations

import contextlib
import io

import pytest

from dgpp.appliance import cli
from dgpp.appliance.common.exit_codes import EXIT_OK
from dgpp.appliance.deployments.deployment import parse_deployment
from dgpp.appliance.deployments.files import find_template, list_templates
from dgpp.appliance.deployments.plan import (
    describe_plans,
    model_config_of,
    plan_deployment,
    refuse_unfit,
    resolve_deployment,
)
from dgpp.appliance.models.facts import FACTS_DIR, facts_config
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.errors import ConfigError
from dgpp.engine.planning.memory_plan import kv_bytes_per_token, rank_cache_specs
from dgpp.engine.planning.state_plan import GIB as SNAPSHOT_GIB
from dgpp.engine.planning.weight_count import rank_weight_bytes

GIB = 1 << 30
# Parameter counts the model cards state (billions), against dgpp's meta-device build at
# world 1 counted at one byte per float: the facts and the families' layer shapes agree.
STATED_PARAMS = {
    "Qwen/Qwen3-30B-A3B": 30.5,
    "zai-org/GLM-4.5-Air": 106.9,  # 110B with the MTP layer, which dgpp does not load
    # 671B (685B with the MTP layer) at FP8, plus its block scales held per row: one float32
    # per 128 columns (+3.1%)
    "deepseek-ai/DeepSeek-V3-0324": 671.0 * (1 + 4 / 128),
    # DeepSeek-V3's 671B plus 61 lightning indexers (wq_b, wk, weights_proj: 0.84B), at FP8
    "deepseek-ai/DeepSeek-V3.2-Exp": 671.84 * (1 + 4 / 128),
    # GLM-5: 744B on the card (without its MTP layer), at FP8
    "zai-org/GLM-5-FP8": 744.0 * (1 + 4 / 128),
    # MiniMax-M2: 230B on the card, at FP8 with block scales as DeepSeek-V3's
    "MiniMaxAI/MiniMax-M2": 230.0 * (1 + 4 / 128),
    # MiMo-V2-Flash: 309B on the card, of which about 1B its three MTP layers (not loaded), at
    # FP8 with block scales; its attention output projections are kept in bfloat16
    "XiaomiMiMo/MiMo-V2-Flash": 308.0 * (1 + 4 / 128),
    # DeepSeek-V4-Flash: 284B on the card (without its MTP layer), of which 277.03B routed
    # experts in FP4 (half a byte, and a bfloat16 scale per 32) and the rest counted at a byte:
    # FP8 (q_b, o_b, shared experts, with block scales) or dequantized at load
    "deepseek-ai/DeepSeek-V4-Flash": 277.03 * (0.5 + 2 / 32) + (284.0 - 277.03),
    # Kimi-Linear: "48B" on the card; 49,122,681,728 parameters in its bfloat16 tensors
    "moonshotai/Kimi-Linear-48B-A3B-Instruct": 49.12,
    "meta-llama/Llama-3.1-8B-Instruct": 8.03,
    "Qwen/Qwen2.5-72B-Instruct": 72.7,
    "Qwen/Qwen3-8B": 8.19,
    # 80B on the card; the FP8 release's tensors hold 81.33B with the MTP layer (1.65B), which
    # dgpp does not load
    "Qwen/Qwen3-Next-80B-A3B-Instruct": 79.68,
}
MOE_TEMPLATES = [
    "qwen3-30b-a3b_bfloat16_w1",
    "qwen3-30b-a3b-fp8_bfloat16_w1",
    "glm-4.5-air-fp8_bfloat16_w1",
    "glm-4.5-air-fp8_bfloat16_w2",
    "gpt-oss-120b_bfloat16_w1",
    "minimax-m2_bfloat16_w4",
    "mimo-v2-flash_bfloat16_w4",
    "kimi-linear-48b-a3b-instruct_bfloat16_w1",
    "kimi-linear-48b-a3b-instruct_bfloat16_w2",
    "deepseek-v4-flash_bfloat16_w2",
    "deepseek-v4-flash_bfloat16_w4",
]


# Qwen3-Next-80B-A3B at FP8 (hybrid: Gated DeltaNet + gated attention + MoE). One recurrent
# state slot is 36 linear layers x ((4 - 1) x conv_dim + heads x 128 x 128) float32 values,
# conv_dim = 2 x 16 x 128 + 32 x 128 at world 1 (key and value heads halve per rank at world 2).
# The snapshot budgets: about one snapshot per 16K tokens of the KV pool (an agent's turn), at
# least three per running stream. One Spark: the model's whole 262,144-token context fits at
# memory_fraction 0.95 with 256-token prefill chunks (512-token ones leave no KV beside their
# fp32 scores); 16 streams fit only with under two snapshots each, so 8 streams, whose ~300K-token
# pool wants ~19 snapshots and the streams 24: 2 GiB (27). Two Sparks: the pool holds ~3.4M
# tokens, ~210 snapshots, so 8 GiB (217 at half the bytes each).
HYBRID_TEMPLATES = {
    "qwen3-next-80b-a3b-instruct-fp8_bfloat16_w1": 36 * (3 * 8192 + 32 * 128 * 128) * 4,
    "qwen3-next-80b-a3b-instruct-fp8_bfloat16_w2": 36 * (3 * 4096 + 16 * 128 * 128) * 4,
}


@pytest.mark.parametrize("repo", sorted(STATED_PARAMS))
def test_facts_give_the_stated_parameter_counts(repo: str) -> None:
    params = rank_weight_bytes(facts_config(repo), 1, 0, 1)  # one byte per float parameter
    assert params / 1e9 == pytest.approx(STATED_PARAMS[repo], rel=0.02)


def test_every_shipped_fact_file_parses() -> None:
    for path in FACTS_DIR.glob("*.json"):
        assert facts_config(path.stem.replace("--", "/")).num_layers > 0


@pytest.mark.parametrize("name", MOE_TEMPLATES)
def test_moe_templates_fit_a_spark_world(name: str) -> None:
    deployment = parse_deployment(find_template(name).load(), name)
    model, source = model_config_of(deployment)
    assert source == "facts"
    plans = plan_deployment(resolve_deployment(deployment, model))
    refuse_unfit(plans)  # raises when a rank does not fit
    for entry in plans:
        assert entry.largest_context >= deployment.engine.max_model_len
        assert entry.kv_bytes_per_token > 0
        assert entry.plan.kv_tokens >= deployment.engine.max_model_len


@pytest.mark.parametrize("name", sorted(HYBRID_TEMPLATES))
def test_hybrid_templates_fit_a_spark_world_with_their_states(name: str) -> None:
    """Each rank holds its running requests' states and the prefix snapshots its budget buys,
    counted in the plan's total, and still serves the model's whole context."""
    deployment = parse_deployment(find_template(name).load(), name)
    model, source = model_config_of(deployment)
    assert source == "facts" and model.max_position_embeddings == 262144
    plans = plan_deployment(resolve_deployment(deployment, model))
    assert len(plans) == deployment.world_size
    refuse_unfit(plans)
    engine = deployment.engine
    mtp = deployment.speculative.method == "mtp"  # two Sparks: one Spark has no room for it
    assert mtp == (deployment.world_size == 2)
    depth = deployment.speculative.depth if mtp else 0
    slot_bytes = HYBRID_TEMPLATES[name]
    for entry in plans:
        states = entry.states
        assert states.slot_bytes == slot_bytes
        assert states.num_running == engine.max_concurrency
        assert states.num_snapshots == int(engine.prefix_cache_gib * SNAPSHOT_GIB) // slot_bytes
        assert states.num_draft_slots == engine.max_concurrency * depth
        assert entry.plan.state_bytes == states.total_bytes > 0
        assert entry.largest_context >= engine.max_model_len == model.max_position_embeddings
        assert entry.plan.kv_tokens >= engine.max_model_len
        layers = 12 + mtp  # the MTP layer's full attention has a KV cache of its own
        assert entry.kv_bytes_per_token == layers * 2 * 256 * 2 * 2 // deployment.world_size
        assert entry.plan.total_bytes <= entry.plan.budget_bytes
    # The FP8 release's tensors: 76.40 GiB, 1.55 GiB of it the MTP layer (loaded with mtp);
    # dgpp holds the 128x128 block scales per row (one float32 per 128 columns, +3.1%).
    weights = sum(entry.plan.weights_bytes for entry in plans)
    expected = 76.40 if mtp else 76.40 - 1.55
    assert weights / GIB == pytest.approx(expected * (1 + 4 / 128), rel=0.01)
    table = describe_plans(plans)
    assert "| states + snapshots |" in table
    drafts = f" + {plans[0].states.num_draft_slots} drafts" if mtp else ""
    snapshots = plans[0].states.num_snapshots
    assert f"x ({engine.max_concurrency} running + {snapshots} snapshots{drafts})" in table


def test_qwen3_next_fp8_facts_keep_dense_what_the_release_keeps_dense() -> None:
    """Its `modules_to_not_convert` names each linear layer's in_proj_ba (64 rows, under one
    128-row scale block): counted bf16, like the routers; every other projection is FP8."""
    schemes = facts_config("Qwen/Qwen3-Next-80B-A3B-Instruct-FP8").quant_schemes
    for dense in ("model.layers.0.linear_attn.in_proj_ba", "model.layers.3.mlp.gate"):
        assert schemes.of(dense) is None
    for packed in (
        "model.layers.0.linear_attn.in_proj_qkvz",
        "model.layers.0.linear_attn.out_proj",
        "model.layers.3.self_attn.q_proj",
        "model.layers.3.mlp.experts.0.down_proj",
        "model.layers.3.mlp.shared_expert.up_proj",
    ):
        scheme = schemes.of(packed)
        assert scheme is not None and scheme.block == (128, 128)


def test_quantized_facts_are_counted_packed() -> None:
    """FP8 about halves the bf16 weights; gpt-oss's MXFP4 experts take ~4.25 bits."""
    bf16 = rank_weight_bytes(facts_config("Qwen/Qwen3-30B-A3B"), 1, 0, 2)
    fp8 = rank_weight_bytes(facts_config("Qwen/Qwen3-30B-A3B-FP8"), 1, 0, 2)
    assert 0.5 < fp8 / bf16 < 0.56
    gpt_oss = rank_weight_bytes(facts_config("openai/gpt-oss-120b"), 1, 0, 2)
    assert 60 * GIB < gpt_oss < 66 * GIB  # the released checkpoint is 65 GB


def test_a_world_that_does_not_fit_is_refused_with_its_numbers() -> None:
    """DeepSeek-V3 at FP8 is 671 GB of weights: four Sparks hold 4 x 128 GB."""
    raw = {
        "model": "deepseek-ai/DeepSeek-V3-0324",
        "world_size": 4,
        "engine": {"dtype": "bfloat16", "device": "cuda", "max_model_len": 16384},
    }
    deployment = parse_deployment(raw)
    plans = plan_deployment(resolve_deployment(deployment, model_config_of(deployment)[0]))
    assert all(entry.largest_context == 0 for entry in plans)
    with pytest.raises(ConfigError, match=r"rank 0: weights 1\d\d\.\d\d GiB .* budget"):
        refuse_unfit(plans)
    eight = rank_weight_bytes(model_config_of(deployment)[0], 8, 0, 2)
    assert eight < plans[0].plan.weights_bytes * 0.55


def test_plan_command_prints_every_rank_and_exits_by_the_verdict() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["deploy", "plan", "--template", "glm-4.5-air-fp8_bfloat16_w2"])
    assert code == EXIT_OK
    text = out.getvalue()
    assert "| 0 |" in text and "| 1 |" in text and "fits" in text
    assert "states + snapshots" not in text  # attention only: no recurrent state to show
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(
            ["deploy", "plan", "--template", "gpt-oss-120b_bfloat16_w1", "--memory-gb", "64"]
        )
    assert code != EXIT_OK
    assert "weights 64.10 GiB" in err.getvalue()  # the refusal names the numbers


def test_every_template_names_a_model_with_facts_or_the_default() -> None:
    for template in list_templates():
        model = template.load()["model"]
        assert model == "default" or (FACTS_DIR / (model.replace("/", "--") + ".json")).is_file()


@pytest.mark.parametrize(
    "architecture",
    ["LlamaForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM",
     "Qwen3NextForCausalLM"],
)  # fmt: skip
def test_ranks_with_the_same_head_share_are_counted_once_and_rightly(architecture: str) -> None:
    """A rank's weights are counted once per head share (`head_shares`): for every rank of
    worlds of 2 and 4 the remembered count equals that rank's own meta build, also where heads
    split unevenly (12 query heads in 6 groups: 2 ranks hold 3 groups each, 4 ranks 2 or 1)."""
    from dgpp.engine.planning import weight_count
    from tests.conftest import tiny_model

    sizes: dict[str, object] = {"num_attention_heads": 12, "num_key_value_heads": 6}
    if architecture in ("LlamaForCausalLM", "Qwen3NextForCausalLM"):
        sizes["hidden_size"] = 96  # whole heads of 8
    if architecture == "Qwen3NextForCausalLM":
        sizes.update(linear_num_key_heads=4, linear_num_value_heads=8)  # whole on 4 ranks
    raw = tiny_model(architecture, **sizes).config
    model = ModelConfig.from_dict(raw.to_dict())
    shares = set()
    for tp_size in (2, 4):
        weight_count._COUNTS.clear()
        for rank in range(tp_size):
            expected = weight_count.count_weights(model, tp_size, rank)
            assert weight_count._weight_counts(model, tp_size, rank) == expected, (tp_size, rank)
            shares.add((tp_size, weight_count.head_shares(model, tp_size, rank)))
    assert len(shares) > 2  # the uneven world of 4 has ranks of two shares


def test_configs_differing_only_beyond_the_typed_fields_are_counted_apart() -> None:
    """Two Qwen3-Next configs alike in every typed field but `mlp_only_layers` (read from the
    raw config: a dense layer 1 or a sparse one) hold different weights; the remembered counts
    must not mix them up (they once did: the key left the raw config out)."""
    from dgpp.engine.planning import weight_count
    from tests.conftest import tiny_model

    raw = tiny_model("Qwen3NextForCausalLM").config.to_dict()
    sparse = ModelConfig.from_dict({**raw, "mlp_only_layers": []})
    dense = ModelConfig.from_dict({**raw, "mlp_only_layers": [1]})
    assert repr(sparse) == repr(dense)
    weight_count._COUNTS.clear()
    for model in (sparse, dense):
        assert weight_count._weight_counts(model, 1, 0) == weight_count.count_weights(model, 1, 0)
    assert weight_count._weight_counts(sparse, 1, 0) != weight_count._weight_counts(dense, 1, 0)


@pytest.mark.parametrize("repo", ["deepseek-ai/DeepSeek-V3.2-Exp", "zai-org/GLM-5-FP8"])
@pytest.mark.parametrize("world", [1, 2])
def test_the_sparse_attention_releases_fit_no_spark_world(repo: str, world: int) -> None:
    """DeepSeek-V3.2 (692 GB at FP8) and GLM-5 (767 GB) on one or two Sparks (or four: 512 GB
    in all): refused with the numbers, and the KV pool counts the indexer keys beside the
    latent in every layer."""
    raw = {
        "model": repo,
        "world_size": world,
        "engine": {"dtype": "bfloat16", "device": "cuda", "max_model_len": 16384},
    }
    deployment = parse_deployment(raw)
    model = model_config_of(deployment)[0]
    plans = plan_deployment(resolve_deployment(deployment, model))
    assert all(entry.largest_context == 0 for entry in plans)
    with pytest.raises(ConfigError, match=r"rank 0: weights \d+\.\d\d GiB .* budget"):
        refuse_unfit(plans)
    latent, keys = 512 + 64, 128  # per layer (GLM-5: every layer runs its indexer by default)
    per_token = kv_bytes_per_token(
        EngineConfig(model=repo, dtype="bfloat16"), rank_cache_specs(model, world, 0)
    )
    assert per_token == model.num_layers * (latent + keys) * 2


@pytest.mark.parametrize("world", [1, 2, 4])
def test_deepseek_v4_flash_at_a_million_tokens(world: int) -> None:
    """DeepSeek-V4-Flash as released (FP8, FP4 experts) with its 1,048,576-token context: no
    key per token in any layer, 320 bytes per token in each of its 21 compressed sparse layers
    (a 512-dim key and a 128-dim indexer key per 4 tokens) and 8 in each of its 20 heavily
    compressed ones, on every rank; the windows and compressor carries a state per request.
    One Spark cannot hold its 155 GiB of weights; two and four serve the whole context."""
    raw = {
        "model": "deepseek-ai/DeepSeek-V4-Flash",
        "world_size": world,
        "engine": {
            "dtype": "bfloat16",
            "device": "cuda",
            "max_model_len": 1048576,
            "block_size": 128,
            "prefill_chunk_tokens": 2048,
            "memory_fraction": 0.9,  # the KV pool sized from the memory left
        },
    }
    deployment = parse_deployment(raw)
    model = model_config_of(deployment)[0]
    engine = EngineConfig(model=str(raw["model"]), dtype="bfloat16", max_model_len=16384)
    per_token = kv_bytes_per_token(engine, rank_cache_specs(model, world, 0))
    assert per_token == 21 * (512 + 128) * 2 // 4 + 20 * 512 * 2 // 128 == 6880
    if world == 1:
        with pytest.raises(ConfigError, match=r"budget 103\.56 GiB, weights 155\.\d\d GiB"):
            resolve_deployment(deployment, model)
        return
    plans = plan_deployment(resolve_deployment(deployment, model))
    refuse_unfit(plans)
    for entry in plans:
        assert entry.largest_context == 1048576 and entry.plan.kv_tokens >= 1048576
        assert entry.plan.workspace_bytes < 8 * GIB  # no dense scores against 1M keys
