"""PyTorch twin of the short depthwise causal convolution Gated DeltaNet layers (Qwen3-Next)
apply to the concatenated q/k/v channels before the delta rule.

Channel d of output token t is `act(bias[d] + sum_j weight[d, j] x[t - W + 1 + j, d])`, the
tokens before the call's first coming from `conv_state`: the last W - 1 inputs (not outputs) of
the sequence so far, oldest first, zeros for a fresh sequence. One call serves a prefill chunk
(any T) and a decode step (T = 1) alike, and splitting a sequence across calls that carry the
state changes nothing.

Layout is time-major, as the projections produce it: x [B, T, D], conv_state [B, W - 1, D].
transformers' cache and the `causal_conv1d` package keep the state channel-first,
[B, D, state_len]: their last W - 1 columns, transposed, are this state.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    activation: Literal["silu"] | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [B, T, D] with weight [D, W] (`nn.Conv1d(groups=D).weight`
    squeezed), bias [D] or None, continuing from conv_state [B, W - 1, D] (None: zeros).

    Returns y [B, T, D] in x's dtype (computed in at least float32) and the new state
    [B, W - 1, D], the last W - 1 inputs including the old state when T < W - 1."""
    batch, _, channels = x.shape
    assert weight.dim() == 2 and weight.shape[0] == channels, (weight.shape, x.shape)
    width = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(batch, width - 1, channels)
    assert conv_state.shape == (batch, width - 1, channels), conv_state.shape
    history = torch.cat((conv_state.to(x.dtype), x), dim=1)  # [B, W - 1 + T, D]
    new_state = history[:, history.shape[1] - (width - 1) :].clone()
    dtype = torch.promote_types(x.dtype, torch.float32)
    y = F.conv1d(
        history.to(dtype).transpose(1, 2),  # [B, D, W - 1 + T]
        weight.to(dtype).unsqueeze(1),  # [D, 1, W]
        None if bias is None else bias.to(dtype),
        groups=channels,
    )  # [B, D, T]
    if activation == "silu":
        y = F.silu(y)
    else:
        assert activation is None, activation
    return y.transpose(1, 2).to(x.dtype), new_state
