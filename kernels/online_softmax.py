"""The online-softmax step the Triton attention kernels share (flash attention's running
maximum and denominator)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(
    m_i: tl.tensor, l_i: tl.tensor, scores: tl.tensor
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """Fold a block of `scores` [rows, keys] (-inf where masked) into the running maximum
    `m_i` and denominator `l_i` [rows]: (new maximum, the factor that rescales what was summed
    so far, the block's weights exp(scores - new maximum), new denominator). A row that has
    seen only masked keys keeps a maximum of -inf, zero weights and its denominator."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)
