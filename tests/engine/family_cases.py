"""The families the parity harness (`family_parity`) runs over: every family dgpp serves, each
in a tiny config whose budgets, windows and compression rates sit far below the harness's
112-token prompt, so every sparse or windowed path really drops tokens."""

from __future__ import annotations

from typing import Any

from tests.engine.family_parity import Family

MOE_QWEN = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
MOE_DEEPSEEK: dict[str, Any] = dict(
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    moe_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
)  # fmt: skip
# DeepSeek-V3.2's and GLM-5's indexer keeps 16 of the context's tokens (32 heads: no ties).
DSA = dict(num_hidden_layers=4, index_topk=16, index_n_heads=32, index_head_dim=16)
# Issue 62's DSA shapes: 4 indexer heads, so many keys score exactly 0 and the budget's cut
# often falls among them (which tied keys are kept must not depend on the chunking).
DSA_TIES = dict(
    hidden_size=128, num_hidden_layers=4, kv_lora_rank=48, q_lora_rank=64, qk_rope_head_dim=16,
    qk_nope_head_dim=32, v_head_dim=32, index_topk=16, index_head_dim=32, index_n_heads=4,
)  # fmt: skip
# DeepSeek-V4 (the shapes): a 16-token window; CSA layers compress by 4 and keep 16
# windows (64 tokens), heavily compressed ones by 16.
V4_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]
DEEPSEEK_V4 = dict(
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, intermediate_size=32,
    head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    sliding_window=16, layer_types=V4_TYPES,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    index_n_heads=16, index_head_dim=16, index_topk=16, hc_mult=2, num_hash_layers=1,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    swiglu_limit=1.0,
)  # fmt: skip
# and with two indexer heads, whose scores tie at the cut
DEEPSEEK_V4_TIES = dict(DEEPSEEK_V4, hidden_size=128, head_dim=32, q_lora_rank=64, o_lora_rank=32,
                        index_n_heads=2, index_head_dim=32, intermediate_size=64)  # fmt: skip
WINDOWED = ["sliding_attention", "full_attention", "sliding_attention"]
GPT_OSS = dict(
    num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, head_dim=16,
    sliding_window=16, layer_types=WINDOWED,
)  # fmt: skip
MIMO_ROPE = {"rope_type": "default", "partial_rotary_factor": 0.334}
MIMO = dict(
    num_hidden_layers=4, head_dim=48, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, n_group=2, topk_group=1, sliding_window=16,
    attention_value_scale=0.707,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "full_attention": {**MIMO_ROPE, "rope_theta": 500000.0},
        "sliding_attention": {**MIMO_ROPE, "rope_theta": 10000.0},
    },
)  # fmt: skip
KIMI = dict(
    num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_head_dim=16,
    linear_num_heads=4, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
)  # fmt: skip
MINIMAX = dict(
    num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)  # fmt: skip

DENSE = [
    Family("llama", "LlamaForCausalLM"),
    Family("qwen2", "Qwen2ForCausalLM"),
    Family("qwen3", "Qwen3ForCausalLM"),
]
MOE = [
    Family("qwen3-moe", "Qwen3MoeForCausalLM", {**MOE_QWEN, "mlp_only_layers": [1]}),
    Family("glm4-moe", "Glm4MoeForCausalLM", {**MOE_DEEPSEEK, "head_dim": 16}),
    Family("minimax-m2", "MiniMaxM2ForCausalLM", MINIMAX),
]
LATENT = [
    Family("deepseek-v3", "DeepseekV3ForCausalLM", {**MOE_DEEPSEEK, "num_hidden_layers": 4}),
    Family("deepseek-v3.2", "DeepseekV32ForCausalLM", {**MOE_DEEPSEEK, **DSA}, reach=16),
    Family(
        "glm-5",
        "GlmMoeDsaForCausalLM",
        {**MOE_DEEPSEEK, **DSA, "index_topk_freq": 2, "index_skip_topk_offset": 1},
        reach=16,
    ),
    Family("deepseek-v4", "DeepseekV4ForCausalLM", DEEPSEEK_V4, reach=64),
]
# The same sparse families with few indexer heads: the budget's cut falls among tied scores.
TIED = [
    Family(
        "deepseek-v3.2-ties",
        "DeepseekV32ForCausalLM",
        {**MOE_DEEPSEEK, **DSA_TIES},
        reach=16,
        ties=True,
    ),
    Family(
        "glm-5-ties",
        "GlmMoeDsaForCausalLM",
        {**MOE_DEEPSEEK, **DSA_TIES, "index_topk_freq": 2, "index_skip_topk_offset": 1},
        reach=16,
        ties=True,
    ),
    Family("deepseek-v4-ties", "DeepseekV4ForCausalLM", DEEPSEEK_V4_TIES, reach=64, ties=True),
    Family("qwen4-exp-ties", "Qwen4ExpForCausalLM", {"indexer_n_heads": 1}, reach=16, ties=True),
]
WINDOWED_AND_SPARSE = [
    Family("gpt-oss", "GptOssForCausalLM", GPT_OSS, reach=16),
    Family("mimo-v2-flash", "MiMoV2FlashForCausalLM", MIMO, reach=16),
    # Qwen4-Exp's block indexer keeps 16 tokens in blocks of 4
    Family("qwen4-exp", "Qwen4ExpForCausalLM", {}, reach=16),
]
HYBRID = [
    Family("qwen3-next", "Qwen3NextForCausalLM", {"mlp_only_layers": [1]}),
    Family("qwen3.5", "Qwen3_5ForCausalLM"),
    Family("qwen3.5-moe", "Qwen3_5MoeForCausalLM"),
    Family("kimi-linear", "KimiLinearForCausalLM", KIMI),
]
