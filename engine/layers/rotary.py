"""Rotary position embeddings with the scaling variants of the Llama and Qwen families
(default, linear, llama3, yarn), applied in the rotate-half (GPT-NeoX) layout; interleaved pairs
(DeepSeek) are brought to that layout first (`deinterleave`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from dgpp.engine.checkpoint.config import RopeConfig
from dgpp.kernels.rope_store_torch import apply_rotary as apply_rotary  # the layers' rotation


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [rotary_dim / 2], attention scaling applied to cos and sin)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(inv_freq, rope, rotary_dim)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    assert rope.original_max_position_embeddings is not None
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv_freq: torch.Tensor, rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    assert rope.original_max_position_embeddings is not None
    factor, base, original = rope.factor, rope.theta, rope.original_max_position_embeddings
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    interpolated = inv_freq / factor
    blended = interpolated * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return blended, attention_factor


RopeAngles = tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding(nn.Module):
    """Holds float32 cos/sin tables for every position below `max_position`.

    The sin table carries the rotate-half sign (`[-sin, sin]`), so rotating is
    `x * cos + roll(x, D/2) * sin`: three kernels instead of the reference's seven.
    """

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        # On the CPU whatever the default device: the tables are numbers, not weights (on the
        # meta device, where the memory plan counts weights, their math would import torch's
        # Python decompositions: seconds); the model moves them with itself.
        with torch.device("cpu"):
            inv_freq, scaling = inverse_frequencies(rope, head_dim)
            positions = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [P, D/2]
            cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [P, D]
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        axis = None
        if rope.mrope_section is not None:
            axis = mrope_axes(rope.mrope_section, head_dim // 2).repeat(2)
        self.register_buffer("mrope_axis", axis, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        """(cos, signed sin), each [T, 1, D], for the token positions [T], or for M-RoPE
        positions [3, T] (time, height, width: each frequency turns by one of them)."""
        if positions.dim() == 2:
            assert self.mrope_axis is not None, "M-RoPE positions for a model without M-RoPE"
            pick = self.mrope_axis.expand(1, positions.shape[1], -1)
            return (
                self.cos[positions].gather(0, pick)[0].unsqueeze(1).to(dtype),
                self.sin[positions].gather(0, pick)[0].unsqueeze(1).to(dtype),
            )
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


def mrope_axes(section: tuple[int, ...], num_frequencies: int) -> torch.Tensor:
    """The axis (0 time, 1 height, 2 width) each rotary frequency follows under interleaved
    M-RoPE: j % 3 == 1 below 3 * section[1] height, j % 3 == 2 below 3 * section[2] width,
    time elsewhere (transformers' `apply_interleaved_mrope`)."""
    axis = torch.zeros(num_frequencies, dtype=torch.int64)
    for which in (1, 2):
        axis[which : section[which] * 3 : 3] = which
    return axis


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... of the last dim into the rotate-half layout (x0, x2, ...,
    x1, x3, ...). Rotating the result with `apply_rotary` rotates each pair by its frequency and
    gives exactly transformers' interleaved rotation (`rope_interleave`, DeepSeek), output
    layout included."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def rotate_leading(x: torch.Tensor, angles: RopeAngles, interleaved: bool = False) -> torch.Tensor:
    """Rope on the first dims of each head of x [T, heads, D], as many as `angles` cover; the
    rest pass through. `interleaved`: those dims come in pairs (output in rotate-half layout,
    as transformers' interleaved rotation leaves it)."""
    rope = angles[0].shape[-1]
    part = deinterleave(x[..., :rope]) if interleaved else x[..., :rope]
    return torch.cat((apply_rotary(part, angles), x[..., rope:]), dim=-1)


def mscale_softmax_factor(rope: RopeConfig) -> float:
    """DeepSeek's softmax-scale correction under scaled RoPE: yarn's mscale(factor,
    mscale_all_dim) squared when `mscale_all_dim` is set, else 1 (transformers'
    `yarn_apply_mscale`, which applies it for any non-default rope type)."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
