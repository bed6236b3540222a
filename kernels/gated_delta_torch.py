"""PyTorch twins of the gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention): the
per-token recurrence for decode and the chunk-parallel form for prefill, equal up to rounding.

Per value head the state S [K, V] evolves, for each token t, as

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

with `g` the log decay (<= 0) and `beta` in (0, 1) the write strength. Layout and signature follow
fla-core's `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` (time-major),
so those Triton kernels can be dispatched in place of these on CUDA:

    q, k [B, T, H, K]   v [B, T, HV, V]   g, beta [B, T, HV]   state [B, HV, K, V]

HV is a multiple of H (grouped value attention): value head j reads key head j // (HV // H), as
`repeat_interleave` on the head axis would give. Kimi Delta Attention (Kimi-Linear) is the same
rule with a decay per key channel, g [B, T, HV, K] (S_t = diag(exp(g_t)) (...)):
`recurrent_gated_delta_rule` takes that g too, and `chunk_kimi_delta_rule` is its chunk form.
All of them return the final state (fla's `output_final_state=True`); `use_qk_l2norm` is fla's
`use_qk_l2norm_in_kernel`. Work is done in float32 (float64 for float64 inputs); the output has
v's dtype, the state the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # fla's and transformers' epsilon: x / sqrt(sum(x^2) + eps)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """Check shapes, cast to the compute dtype, normalise and scale q/k, expand key heads to
    value heads and move heads before time: q, k [B, HV, T, K], v [B, HV, T, V], g, beta
    [B, HV, T], state [B, HV, K, V]."""
    batch, seq_len, num_k_heads, k_dim = k.shape
    num_v_heads, v_dim = v.shape[2], v.shape[3]
    assert q.shape == k.shape, (q.shape, k.shape)
    assert v.shape[:2] == (batch, seq_len), (v.shape, k.shape)
    assert beta.shape == (batch, seq_len, num_v_heads), (beta.shape, v.shape)
    assert g.shape in (beta.shape, (*beta.shape, k_dim)), (g.shape, beta.shape)  # KDA: per channel
    assert num_v_heads % num_k_heads == 0, (num_v_heads, num_k_heads)
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + L2NORM_EPS)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + L2NORM_EPS)
    q = q * (k_dim**-0.5 if scale is None else scale)
    group = num_v_heads // num_k_heads
    if group > 1:
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    if initial_state is None:
        state = v.new_zeros(batch, num_v_heads, k_dim, v_dim)
    else:
        assert initial_state.shape == (batch, num_v_heads, k_dim, v_dim), initial_state.shape
        state = initial_state.to(dtype)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return q, k, v, g.transpose(1, 2), beta.transpose(1, 2), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (decode, speculative verify: T is small).

    q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV], initial_state [B, HV, K, V] or None
    (zeros); `scale` None means K ** -0.5. Returns out [B, T, HV, V] and the state after the
    last token [B, HV, K, V]."""
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    decay = g.exp()  # [B, HV, T], or [B, HV, T, K] per key channel
    if decay.dim() == 3:
        decay = decay.unsqueeze(-1)
    outputs = []
    for t in range(q.shape[2]):
        state = state * decay[:, :, t, :, None]
        k_t = k[:, :, t]  # [B, HV, K]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]  # [B, HV, V]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    out = torch.stack(outputs, dim=1) if outputs else v.transpose(1, 2).clone()  # [B, T, HV, V]
    return out.to(out_dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule chunk by chunk (prefill); same arguments and results as
    `recurrent_gated_delta_rule`, T any length.

    Within a chunk of C tokens starting from state S, with G the cumulative log decay since the
    chunk's start and Γ_ti = exp(G_t - G_i), each token writes k_i u_i^T, where u_i (what the
    delta rule adds: beta_i times the value minus what the decayed state already predicts) is

        u_i = beta_i v_i - beta_i exp(G_i) S^T k_i - sum_{j<i} beta_i Γ_ij (k_i . k_j) u_j.

    That is (I + A) U = diag(beta) V - diag(beta exp(G)) K S with A strictly lower triangular
    (the WY / UT representation), so U = U0 - W S where U0 and W come from one unit-triangular
    solve per chunk, independent of S and done for all chunks at once. Then per chunk

        O = diag(exp(G)) Q S + (Q K^T * Γ, causal incl. diagonal) U
        S' = exp(G_C) S + (diag(exp(G_C - G)) K)^T U

    and only these matmuls run in the loop over chunks. Padding tokens (k = v = q = 0,
    g = beta = 0) leave the state unchanged, so the tail chunk needs no mask."""
    assert chunk_size > 0, chunk_size
    out_dtype = v.dtype
    seq_len = q.shape[1]
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    pad = -seq_len % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    batch, heads, padded_len, _ = k.shape
    num_chunks, c = padded_len // chunk_size, chunk_size
    q, k, v = (x.reshape(batch, heads, num_chunks, c, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, num_chunks, c) for x in (g, beta))  # [B, HV, N, C]

    cum = g.cumsum(-1)  # G, [B, HV, N, C]
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # G_t - G_i, [B, HV, N, C, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: above the diagonal G_t - G_i > 0 and could overflow.
    gamma = diff.masked_fill(~causal, float("-inf")).exp()  # Γ, zero above the diagonal

    k_beta = k * beta.unsqueeze(-1)  # [B, HV, N, C, K]
    # A_ij = beta_i Γ_ij (k_i . k_j) for j < i; the diagonal (beta_i |k_i|^2) becomes 1.
    system = (k_beta @ k.transpose(-1, -2)) * gamma  # [B, HV, N, C, C]
    system = system.tril(-1) + torch.eye(c, dtype=q.dtype, device=q.device)  # I + A
    rhs = torch.cat((v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u0, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]  # [.., C, V], [.., C, K]

    scores = (q @ k.transpose(-1, -2)) * gamma  # [B, HV, N, C, C], causal incl. diagonal
    q_decayed = q * cum.exp().unsqueeze(-1)  # [B, HV, N, C, K]
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # [B, HV, N, C, K]
    chunk_decay = cum[..., -1].exp()  # [B, HV, N]

    outputs = []
    for n in range(num_chunks):
        u = u0[:, :, n] - w[:, :, n] @ state  # [B, HV, C, V]
        outputs.append(q_decayed[:, :, n] @ state + scores[:, :, n] @ u)
        state = state * chunk_decay[:, :, n, None, None] + k_to_end[:, :, n].transpose(-1, -2) @ u
    if not outputs:  # T == 0
        return v.new_zeros(batch, 0, heads, v.shape[-1]).to(out_dtype), state
    out = torch.cat(outputs, dim=2)[:, :, :seq_len]  # [B, HV, T, V]
    return out.transpose(1, 2).to(out_dtype), state


def chunk_kimi_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention chunk by chunk: `chunk_gated_delta_rule` with g [B, T, HV, K], a
    cumulative decay G per key channel, so every Γ_ti (k_t . k_i) becomes
    sum_c k_t[c] k_i[c] exp(G_t[c] - G_i[c]) and the decayed state diag(exp(G_t)) S. Those
    pairwise terms are [C, C, K] per head, so the solve runs per chunk, in the loop."""
    assert chunk_size > 0, chunk_size
    out_dtype = v.dtype
    seq_len = q.shape[1]
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    assert g.dim() == 4, "a decay per key channel, [B, T, HV, K]"
    pad = -seq_len % chunk_size
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    batch, heads, padded_len, _ = k.shape
    num_chunks, c = padded_len // chunk_size, chunk_size
    q, k, v, g = (x.reshape(batch, heads, num_chunks, c, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(batch, heads, num_chunks, c, 1)
    cum = g.cumsum(-2)  # G, [B, HV, N, C, K]
    above = ~torch.ones(c, c, dtype=torch.bool, device=q.device).tril()[..., None]
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    outputs = []
    for n in range(num_chunks):
        big_g, k_n, q_n = cum[:, :, n], k[:, :, n], q[:, :, n]
        diff = big_g[:, :, :, None] - big_g[:, :, None]  # G_t - G_i, [B, HV, C, C, K]
        gamma = diff.masked_fill(above, float("-inf")).exp()  # zero above the diagonal
        k_beta = k_n * beta[:, :, n]
        system = torch.einsum("bhtc,bhic,bhtic->bhti", k_beta, k_n, gamma).tril(-1) + eye
        rhs = torch.cat((v[:, :, n] * beta[:, :, n], k_beta * big_g.exp()), dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u = solved[..., : v.shape[-1]] - solved[..., v.shape[-1] :] @ state  # [B, HV, C, V]
        scores = torch.einsum("bhtc,bhic,bhtic->bhti", q_n, k_n, gamma)
        outputs.append((q_n * big_g.exp()) @ state + scores @ u)
        to_end = (k_n * (big_g[:, :, -1:] - big_g).exp()).transpose(-1, -2)
        state = state * big_g[:, :, -1, :, None].exp() + to_end @ u
    if not outputs:  # T == 0
        return v.new_zeros(batch, 0, heads, v.shape[-1]).to(out_dtype), state
    out = torch.cat(outputs, dim=2)[:, :, :seq_len]  # [B, HV, T, V]
    return out.transpose(1, 2).to(out_dtype), state
