"""The Llama decoder family: Llama (SmolLM2), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm).

Tensor-parallel layout: fused QKV and gate/up projections column-parallel, attention output and
down projections row-parallel, embedding and LM head vocabulary-parallel. The other families
share this skeleton, subclassing `LlamaForCausalLM` to override `build_mlp` (Qwen3-MoE, GLM-4.5,
gpt-oss), `attention_options` (gpt-oss: sinks, sliding windows) or `build_attention` with
`rotary_dim` (DeepSeek-V3: latent attention).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from dgpp.engine.backends.base import PagedAttentionBackend, StepMetadata
from dgpp.engine.backends.cache_spec import CacheSpec, PagedKVSpec
from dgpp.engine.backends.state_cache import LinearStateSpec
from dgpp.engine.checkpoint.config import ModelConfig
from dgpp.engine.configuration.parallel import ParallelContext
from dgpp.engine.layers.activation import SiluAndMul
from dgpp.engine.layers.attention import PagedAttention
from dgpp.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from dgpp.engine.layers.head_partition import partition_heads
from dgpp.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from dgpp.engine.layers.norm import ResidualNorm, RMSNorm
from dgpp.engine.layers.rotary import RopeAngles, RotaryEmbedding, apply_rotary
from dgpp.engine.vision.step_vision import VisionInputs


class DecoderAttention(nn.Module):
    """`options` are the layer's own attention options (gpt-oss: `sliding_window`,
    `has_sinks`), passed to its `PagedAttention`."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: PagedAttentionBackend,
        prefix: str = "",
        options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        qkv = [f"{prefix}.{name}" for name in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.qkv_bias,
            parallel,
            config.weight_format(qkv, config.hidden_size),
        )
        self.num_heads = self.qkv_proj.num_heads_local
        self.num_kv_heads = self.qkv_proj.num_kv_heads_local
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        heads = self.qkv_proj.heads
        input_range = (heads.q_start * config.head_dim, heads.num_q * config.head_dim)
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            config.o_proj_bias,
            parallel,
            input_range=input_range,
            weight_format=config.weight_format(
                [f"{prefix}.o_proj"],
                input_range[1],
                input_range[0],
                config.num_heads * config.head_dim,
            ),
        )
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            config.head_dim,
            config.head_dim**-0.5,
            attention,
            first_head=heads.q_start,
            **(options or {}),
        )

    def forward(
        self,
        angles: RopeAngles,
        hidden: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden).view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
        v = qkv[:, num_heads + num_kv_heads :]  # [T, H_kv, D]
        if self.attn.fuses_rope and self.rotary_dim == self.head_dim:
            # The backend rotates q and k as it stores k (one pass over them, Triton on CUDA).
            q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            out = self.attn(q, k, v, metadata, angles)
            return self.o_proj(out.view(num_tokens, num_heads * head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q = self._rotate(self.q_norm(qkv[:, :num_heads]), angles)
            k = self._rotate(self.k_norm(qkv[:, num_heads : num_heads + num_kv_heads]), angles)
        else:
            # q and k are adjacent heads in the fused output: rotate them in one pass.
            qk = self._rotate(qkv[:, : num_heads + num_kv_heads], angles)
            q, k = qk[:, :num_heads], qk[:, num_heads:]
        out = self.attn(q, k, v, metadata)  # [T, H, D]
        return self.o_proj(out.view(num_tokens, num_heads * head_dim))

    def _rotate(self, x: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
        """Rotary on each head's first `rotary_dim` dims (partial rotary: the rest pass)."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, angles)
        rotated = apply_rotary(x[..., : self.rotary_dim], angles)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


class DecoderMLP(nn.Module):
    """The SwiGLU MLP; `intermediate_size` overrides the config's (MoE shared experts)."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        prefix: str = "",
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        intermediate = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [intermediate] * 2,
            config.mlp_bias,
            parallel,
            config.weight_format([f"{prefix}.gate_proj", f"{prefix}.up_proj"], config.hidden_size),
        )
        local = intermediate // parallel.tp_size
        self.down_proj = RowParallelLinear(
            intermediate,
            config.hidden_size,
            config.mlp_bias,
            parallel,
            weight_format=config.weight_format(
                [f"{prefix}.down_proj"], local, parallel.tp_rank * local, intermediate
            ),
        )
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))

    def partial(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, not yet summed over the ranks (no bias): for a
        block that joins it with other partial sums in one all-reduce."""
        return self.down_proj.matmul(self.act(self.gate_up_proj(hidden)), with_bias=False)


def no_attention_options(config: ModelConfig, index: int) -> Mapping[str, Any]:
    """Plain causal attention in every layer."""
    del config, index
    return {}


class DecoderLayer(nn.Module):
    """Pre-norm residual layer around any token mixer (`forward(angles, hidden, metadata)`),
    under the checkpoint's name for it (`self_attn`; Qwen3-Next's linear layers: `linear_attn`),
    and any MLP; `norm` is the norms' class (Qwen3-Next: zero-centred)."""

    def __init__(
        self,
        config: ModelConfig,
        self_attn: nn.Module,
        mlp: nn.Module,
        mixer_name: str = "self_attn",
        norm: type[ResidualNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.add_module(mixer_name, self_attn)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        angles: RopeAngles,
        hidden: torch.Tensor,
        metadata: StepMetadata,
    ) -> torch.Tensor:
        mixer = self._modules[self.mixer_name]
        mixed = mixer(angles, self.input_layernorm(hidden), metadata)
        normed, hidden = self.post_attention_layernorm.add_forward(mixed, hidden)
        return hidden + self.mlp(normed)


class DecoderModel(nn.Module):
    """Embedding, the rotary tables (for `rotary_dim` dims), the layers and the final norm.
    `plain_residual`: the residual stream is all that passes between layers."""

    plain_residual: ClassVar[bool] = True

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        rotary_dim: int,
        layers: list[nn.Module],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            parallel,
            config.weight_formats.packed(["model.embed_tokens"]),
        )
        self.rotary = RotaryEmbedding(rotary_dim, max_position, config.rope)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
        vision: VisionInputs | None = None,
    ) -> torch.Tensor:
        """`vision`: a step's image tokens (vision-language models), their embeddings in place
        of their placeholders' and DeepStack features added after the first layers."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        if vision is not None:
            hidden = vision.merge(hidden)
        angles = self.layer_angles(positions, hidden.dtype)
        for index, layer in enumerate(self.layers):
            hidden = layer(angles[index], hidden, metadata)
            if vision is not None:
                hidden = vision.after_layer(index, hidden)
        return self.norm(hidden)

    def layer_angles(self, positions: torch.Tensor, dtype: torch.dtype) -> Sequence[RopeAngles]:
        """Each layer's rotary angles: one table's, looked up once for all."""
        return [self.rotary.lookup(positions, dtype)] * len(self.layers)

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: StepMetadata,
        layers: tuple[int, int],
        vision: VisionInputs | None = None,
    ) -> torch.Tensor:
        """Layers `first .. stop` of a layer slice (`dgpp.engine.scheduling.layer_slices`): from the
        embedding of `input_ids` when `first` is 0, else from `hidden`, the residual stream the
        previous slice left; normed when `stop` is the last layer (as `forward` returns it)."""
        first, stop = layers
        if first == 0:
            hidden = self.embed_tokens(input_ids)
            hidden = vision.merge(hidden) if vision is not None else hidden
        assert hidden is not None, "a slice past the first layer continues a kept stream"
        angles = self.layer_angles(positions, hidden.dtype)
        for index in range(first, stop):
            hidden = self.layers[index](angles[index], hidden, metadata)
            hidden = vision.after_layer(index, hidden) if vision is not None else hidden
        return self.norm(hidden) if stop == len(self.layers) else hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM head over `DecoderModel`; also serves Qwen2 and Qwen3 (flags in ModelConfig)."""

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    decoder_model: type[DecoderModel] = DecoderModel  # Qwen4-Exp: hyper-connection streams

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        max_position: int,
        attention: PagedAttentionBackend,
    ) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        for index in range(config.num_layers):
            layers.append(
                self.build_layer(config, parallel, attention, index, f"model.layers.{index}")
            )
        self.model = self.decoder_model(
            config, parallel, max_position, self.rotary_dim(config), layers
        )
        head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            parallel,
            config.weight_formats.packed([head]),
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_layer(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        index: int,
        prefix: str,
    ) -> nn.Module:
        """Layer `index`: attention and MLP in a pre-norm `DecoderLayer` (hybrids: their own)."""
        self_attn = self.build_attention(config, parallel, attention, index, prefix)
        mlp = self.build_mlp(config, parallel, index, f"{prefix}.mlp")
        return DecoderLayer(config, self_attn, mlp)

    @staticmethod
    def build_mlp(
        config: ModelConfig, parallel: ParallelContext, index: int, prefix: str
    ) -> nn.Module:
        """Layer `index`'s MLP (dense here; the MoE families override this)."""
        del index
        return DecoderMLP(config, parallel, prefix)

    attention_options = staticmethod(no_attention_options)

    @classmethod
    def build_attention(
        cls,
        config: ModelConfig,
        parallel: ParallelContext,
        attention: Any,
        index: int,
        prefix: str,
    ) -> nn.Module:
        """Layer `index`'s attention over `attention`, the backend the runner selected."""
        options = cls.attention_options(config, index)
        return DecoderAttention(config, parallel, attention, f"{prefix}.self_attn", options)

    @staticmethod
    def rotary_dim(config: ModelConfig) -> int:
        """How many dims of each head the shared rotary tables turn."""
        return config.rotary_dim

    @classmethod
    def cache_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[CacheSpec]:
        """What each layer's cache will be on this rank, known before the model is built (the
        memory plan sizes the pools from it; the runner checks the built layers agree)."""
        heads = partition_heads(
            config.num_heads, config.num_kv_heads, parallel.tp_size, parallel.tp_rank
        )
        return [PagedKVSpec(heads.num_kv, config.head_dim)] * config.num_layers

    @classmethod
    def state_specs(cls, config: ModelConfig, parallel: ParallelContext) -> list[LinearStateSpec]:
        """Each recurrent layer's per-request state on this rank (hybrid models; none here)."""
        del config, parallel
        return []

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
        vision: VisionInputs | None = None,
    ) -> torch.Tensor:
        if vision is None:  # the decoders that take no images need not know the argument
            return self.model(input_ids, positions, metadata)
        return self.model(input_ids, positions, metadata, vision)

    @property
    def num_slice_layers(self) -> int:
        """Layers a prompt chunk may be computed over in slices, one step each (the plain
        decoder's residual stream is all a slice hands the next); 0 where the decoder carries
        more between layers (hyper-connection streams, recurrent states)."""
        plain = self.model.plain_residual and not any(
            hasattr(layer, "state_spec") for layer in self.model.layers.modules()
        )
        return len(self.model.layers) if plain else 0

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Logits [N, padded_vocab] for hidden [N, hidden]; `dtype` overrides the compute dtype."""
        return self.lm_head.compute_logits(hidden, dtype)
