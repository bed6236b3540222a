"""What keeping weights packed saves in memory, as the memory plan counts it: every layer that
`ModelConfig.weight_format` packs (GGUF blocks or a group-quantized form), in its packed bytes
instead of the run dtype's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgpp.engine.layers.head_partition import partition_heads
from dgpp.engine.quant.ggml_blocks import FORMATS
from dgpp.engine.quant.group_codes import GroupFormat, group_bytes

if TYPE_CHECKING:
    from dgpp.engine.config import ModelConfig
    from dgpp.engine.memory_plan import RankShapes

_SCALE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def packed_bytes(fmt: str | GroupFormat, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] weight kept in `fmt`."""
    if isinstance(fmt, GroupFormat):
        extra = (4 * rows if fmt.global_mode else 0) + (8 * cols if fmt.act_order else 0)
        return group_bytes(fmt, rows, cols, _SCALE_BYTES[fmt.scale_dtype], fmt.zeros) + extra
    spec = FORMATS[fmt]
    return rows * (cols // spec.block_size) * spec.type_size


def packed_savings(
    model: ModelConfig, shapes: RankShapes, dtype_bytes: int, tp_size: int, tp_rank: int
) -> int:
    """Bytes one rank saves by keeping packed weights packed instead of in the run dtype: the
    layers `model.weight_format` packs, as the model builds them."""
    if not model.weight_formats and not model.quant_schemes:
        return 0
    hidden, head_dim, inter = model.hidden_size, model.head_dim, shapes.intermediate_size
    heads = partition_heads(model.num_heads, model.num_kv_heads, tp_size, tp_rank)
    qkv_rows = (shapes.num_heads + 2 * shapes.num_kv_heads) * head_dim
    q_start, q_cols = heads.q_start * head_dim, heads.num_q * head_dim
    groups: list[tuple[str | GroupFormat | None, int, int]] = []
    for index in range(model.num_layers):
        attn, mlp = f"model.layers.{index}.self_attn", f"model.layers.{index}.mlp"
        qkv = [f"{attn}.{n}" for n in ("q_proj", "k_proj", "v_proj")]
        q_total = model.num_heads * head_dim
        o_proj = model.weight_format([f"{attn}.o_proj"], q_cols, q_start, q_total)
        gate_up = model.weight_format([f"{mlp}.gate_proj", f"{mlp}.up_proj"], hidden)
        down = model.weight_format(
            [f"{mlp}.down_proj"], inter, tp_rank * inter, model.intermediate_size
        )
        groups += [
            (model.weight_format(qkv, hidden), qkv_rows, hidden),
            (o_proj, hidden, q_cols),
            (gate_up, 2 * inter, hidden),
            (down, hidden, inter),
        ]
    formats = model.weight_formats
    groups.append((formats.packed(["model.embed_tokens"]), shapes.vocab_rows, hidden))
    if not model.tie_word_embeddings:
        groups.append((formats.packed(["lm_head"]), shapes.vocab_rows, hidden))
    return sum(
        rows * cols * dtype_bytes - packed_bytes(fmt, rows, cols)
        for fmt, rows, cols in groups
        if fmt is not None
    )
