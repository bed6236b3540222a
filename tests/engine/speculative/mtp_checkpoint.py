"""Tiny DeepSeek-V3 and GLM-4.5 checkpoints with a multi-token-prediction layer appended, as
released checkpoints store it (`model.layers.{num_hidden_layers}.*`, per-expert names), and
tiny Qwen3-Next and Qwen3.5-MoE ones with their `mtp.*` layer: transformers' save_pretrained
writes none."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.deepseek_v32 import modeling_deepseek_v32
from transformers.models.glm4_moe import modeling_glm4_moe
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

ARCH = "DeepseekV3ForCausalLM"
MOE = dict(
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, n_group=2, topk_group=1,
)  # fmt: skip
# family -> (architecture, tiny config overrides, transformers' module, its class prefix)
FAMILIES = {
    "deepseek-v3": (ARCH, MOE, modeling_deepseek_v3, "DeepseekV3"),
    "glm-4.5": (
        "Glm4MoeForCausalLM",
        dict(MOE, head_dim=16, attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.5),
        modeling_glm4_moe,
        "Glm4Moe",
    ),
}
# DeepSeek-V3.2: an MTP layer with its own indexer (tests/engine/models/test_sparse_attention.py)
SPARSE_FAMILIES = {
    "deepseek-v3.2": ("DeepseekV32ForCausalLM", MOE, modeling_deepseek_v32, "DeepseekV32"),
}


def hf_class(config: object, name: str) -> type:
    """transformers' `{prefix}{name}` class (DecoderLayer, RMSNorm, RotaryEmbedding) of the
    family whose config this is."""
    for _, _, module, prefix in (*FAMILIES.values(), *SPARSE_FAMILIES.values()):
        if type(config).__name__ == f"{prefix}Config":
            return getattr(module, prefix + name)
    raise KeyError(type(config).__name__)


def init_layer(layer: torch.nn.Module) -> None:
    """Draw every parameter (a bare transformers layer leaves some uninitialised): norms near 1,
    the rest small."""
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))


def with_mtp_layer(checkpoint: Path) -> tuple[dict[str, torch.Tensor], object]:
    """Append a random MTP layer (index N = num_hidden_layers) to the checkpoint; its tensors.
    A family whose layers read per-layer lists (DeepSeek-V3.2's `mlp_layer_types`) builds the
    block as its last layer, a MoE one, stored as layer N."""
    config = AutoConfig.from_pretrained(str(checkpoint))
    index = config.num_hidden_layers
    built = index - 1 if getattr(config, "mlp_layer_types", None) else index
    torch.manual_seed(7)
    block = hf_class(config, "DecoderLayer")(config, built).float()
    init_layer(block)
    hidden = config.hidden_size
    tensors = {f"model.layers.{index}.{k}": v for k, v in per_expert(block.state_dict()).items()}
    own = {
        "enorm.weight": 1 + 0.1 * torch.randn(hidden),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
        "eh_proj.weight": torch.randn(hidden, 2 * hidden) / (2 * hidden) ** 0.5,
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
        "shared_head.head.weight": 0.05 * torch.randn(config.vocab_size, hidden),
        "embed_tokens.weight": torch.randn(config.vocab_size, hidden),  # a duplicate: skipped
    }
    tensors.update({f"model.layers.{index}.{k}": v for k, v in own.items()})
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file(
        {**weights, **tensors}, str(checkpoint / "model.safetensors"), metadata={"format": "pt"}
    )
    return {k.split(f"layers.{index}.", 1)[1]: v for k, v in tensors.items()}, config


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts ([E, 2I, H] gate then up; [E, H, I]) under the per-expert
    names released checkpoints use (a dense layer's: unchanged)."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    if len(out) == len(state):
        return out
    gate_up, down = state["mlp.experts.gate_up_proj"], state["mlp.experts.down_proj"]
    inner = down.shape[-1]
    for expert in range(gate_up.shape[0]):
        at = f"mlp.experts.{expert}"
        out[f"{at}.gate_proj.weight"] = gate_up[expert, :inner].clone()
        out[f"{at}.up_proj.weight"] = gate_up[expert, inner:].clone()
        out[f"{at}.down_proj.weight"] = down[expert].clone()
    return out


def stacked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_per_expert`, for transformers' layer (a dense one: unchanged)."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    if len(out) == len(state):
        return out
    count = len({k.split(".")[2] for k in state if ".experts." in k})
    gate_up, down = [], []
    for expert in range(count):
        at = f"mlp.experts.{expert}"
        gate_up.append(torch.cat((state[f"{at}.gate_proj.weight"], state[f"{at}.up_proj.weight"])))
        down.append(state[f"{at}.down_proj.weight"])
    out["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    out["mlp.experts.down_proj"] = torch.stack(down)
    return out


# Qwen3-Next and Qwen3.5-MoE store their MTP layer as `mtp.*` (models.mtp.qwen_mtp_names):
# family -> (architecture, tiny config overrides, transformers' module, class prefix, stacked)
QWEN_FAMILIES = {
    "qwen3-next": (
        "Qwen3NextForCausalLM", {"mlp_only_layers": [1]}, modeling_qwen3_next, "Qwen3Next", False
    ),  # its config declares no MTP layer, as the releases'
    "qwen3.5": (
        "Qwen3_5ForCausalLM", {"mtp_num_hidden_layers": 1}, modeling_qwen3_5, "Qwen3_5", False
    ),
    "qwen3.5-moe": (
        "Qwen3_5MoeForCausalLM", {"mtp_num_hidden_layers": 1}, modeling_qwen3_5_moe, "Qwen3_5Moe",
        True,
    ),
}  # fmt: skip


def qwen_class(family: str, name: str) -> type:
    _, _, module, prefix, _ = QWEN_FAMILIES[family]
    if name == "RotaryEmbedding" and prefix.startswith("Qwen3_5"):
        name = "TextRotaryEmbedding"
    return getattr(module, prefix + name)


def qwen_mtp_block(family: str, config: object) -> torch.nn.Module:
    """transformers' decoder layer of the family as a full-attention MoE layer (the MTP
    block's kind): built at the index of the config's first full-attention layer."""
    index = list(config.layer_types).index("full_attention")
    return qwen_class(family, "DecoderLayer")(config, index).float()


def with_qwen_mtp_layer(checkpoint: Path, family: str) -> tuple[dict[str, torch.Tensor], object]:
    """Append a random `mtp.*` layer to the checkpoint; its tensors (names after `mtp.`). The
    block's experts stay stacked where the family's released checkpoints stack them."""
    config = AutoConfig.from_pretrained(str(checkpoint))
    torch.manual_seed(11)
    block = qwen_mtp_block(family, config)
    init_layer(block)
    for name, param in block.named_parameters():  # zero-centred norms: weights near 0
        if name.endswith("norm.weight"):
            param.data.sub_(1.0)
    state = block.state_dict()
    state = state if QWEN_FAMILIES[family][4] else per_expert(state)
    hidden = config.hidden_size
    tensors = {f"layers.0.{k}": v for k, v in state.items()}
    tensors.update(
        {
            "pre_fc_norm_embedding.weight": 0.1 * torch.randn(hidden),
            "pre_fc_norm_hidden.weight": 0.1 * torch.randn(hidden),
            "fc.weight": torch.randn(hidden, 2 * hidden) / (2 * hidden) ** 0.5,
            "norm.weight": 0.1 * torch.randn(hidden),
        }
    )
    weights = load_file(str(checkpoint / "model.safetensors"))
    stored = {f"mtp.{k}": v.contiguous() for k, v in tensors.items()}
    save_file(
        {**weights, **stored}, str(checkpoint / "model.safetensors"), metadata={"format": "pt"}
    )
    return tensors, config
