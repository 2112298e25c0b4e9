"""Chunked KDA in PyTorch: WY representation with the UT transform, chunk 64, sub-chunks of 16.

Shape legend: B batch, T time, H heads, K key dim, V value dim, N chunks (or packed sequences at the API),
C chunk length (64), S sub-chunk length (16), NS sub-chunks per chunk (4).

Within a chunk, with G the cumulative log decay from the chunk start (G_t = g_1 + ... + g_t, per channel) and
S0 the state entering the chunk, the per-token deltas d_t = b_t (v_t - k_t^T Diag(e^{g_t}) S_{t-1}) solve

    (I + A) D = diag(b) (V - (K * e^G) S0),   A_tj = b_t sum_c k_tc k_jc e^{G_tc - G_jc}  (j < t)

so D = U - W S0 with U = T V, W = T (K * e^G), T = (I + A)^{-1} diag(b) (the UT transform; the inverse is
built by block forward substitution). Outputs and the next state follow from D with plain matmuls:

    O  = (Q * e^G) S0 + M D,              M_tj = sum_c q_tc k_jc e^{G_tc - G_jc}  (j <= t)
    S1 = Diag(e^{G_C}) S0 + (K * e^{G_C - G})^T D

Everything that does not depend on S0 is computed for all chunks at once; the loop over chunks is one
[K, K] x [K, V] matmul per chunk (S1 = P S0 + R).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.kda.utils import run_recurrence

CHUNK = 64
SUB = 16
# Two exp factors of at most e^44 multiply to < e^88.7 (fp32 max), so factored products stay finite.
# With the K3 lower bound -5 the offsets inside a 16-token sub-chunk from its middle token are < 5 * 8 = 40.
_SAFE_EXP = 44.0
# exp() of arguments below about -87 lands in fp32's denormal range and runs ~15x slower on CPUs; a decay of
# e^-60 is already zero next to the O(1) terms it is summed with, so exponents are floored there.
_EXP_FLOOR = -60.0


def _decay(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for a log decay x <= 0, floored at e^-60 (see _EXP_FLOOR)."""
    return x.clamp(min=_EXP_FLOOR).exp()


def _diag_block_scores(
    qs: torch.Tensor, ks: torch.Tensor, Gs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise decayed scores inside each sub-chunk.

    qs, ks, Gs: [..., NS, S, K] -> (q-k scores, k-k scores) [..., NS, S, S], entry (t, j) = sum_c x_tc k_jc e^{G_tc - G_jc},
    valid for j <= t (callers mask the rest).
    """
    mid = Gs.shape[-2] // 2
    offset = Gs - Gs[..., mid : mid + 1, :]
    if offset.abs().amax() <= _SAFE_EXP:
        # Bounded gates (the K3 form): fold the decay into q and k around the sub-chunk's middle token,
        # so the block is a plain matmul.
        up, down = offset.exp(), (-offset).exp()  # |offset| <= 44: no underflow
        kd = (ks * down).transpose(-1, -2)
        return (qs * up) @ kd, (ks * up) @ kd
    # Unbounded gates (softplus form) can decay by more than e^-88 inside a sub-chunk: form e^{G_t - G_j}
    # per pair instead. Clamping at 0 only touches pairs j > t, which are masked later, and keeps them finite.
    pair = _decay((Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).clamp(max=0))  # [..., NS, S(t), S(j), K]
    kp = ks.unsqueeze(-3) * pair
    return (qs.unsqueeze(-2) * kp).sum(-1), (ks.unsqueeze(-2) * kp).sum(-1)


def _intra_chunk_scores(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed score matrices of each chunk.

    q, k, G: [..., C, K] (G cumulative from the chunk start, <= 0 and non-increasing).
    Returns M [..., C, C] (q-k, j <= t) and Akk [..., C, C] (k-k, j < t), zero elsewhere.
    Every exponent formed here is bounded: across sub-chunks both factors are <= 1 (anchored at the last token
    before the row's sub-chunk); inside a sub-chunk see _diag_block_scores.
    """
    C = G.shape[-2]
    ns = C // SUB
    qs, ks, Gs = (x.unflatten(-2, (ns, SUB)) for x in (q, k, G))
    diag_q, diag_k = _diag_block_scores(qs, ks, Gs)  # [..., NS, S, S]
    t = torch.arange(SUB, device=G.device)
    zero = q.new_zeros(())
    diag_q = torch.where(t[:, None] >= t[None, :], diag_q, zero).unbind(-3)
    diag_k = torch.where(t[:, None] > t[None, :], diag_k, zero).unbind(-3)
    qs, ks, Gs = qs.unbind(-3), ks.unbind(-3), Gs.unbind(-3)
    rows_q, rows_k = [], []
    for a in range(ns):
        start = a * SUB
        blocks_q, blocks_k = [diag_q[a]], [diag_k[a]]
        if a:
            # Columns before this sub-chunk only: the score rows of sub-chunk a cover a*S earlier tokens.
            anchor = G[..., start - 1 : start, :]  # [..., 1, K]
            cols = (k[..., :start, :] * _decay(anchor - G[..., :start, :])).transpose(-1, -2)  # [..., K, a*S]
            row_decay = _decay(Gs[a] - anchor)  # [..., S, K]
            blocks_q.insert(0, (qs[a] * row_decay) @ cols)
            blocks_k.insert(0, (ks[a] * row_decay) @ cols)
        pad = (0, C - start - SUB)
        rows_q.append(F.pad(torch.cat(blocks_q, -1), pad))
        rows_k.append(F.pad(torch.cat(blocks_k, -1), pad))
    return torch.cat(rows_q, -2), torch.cat(rows_k, -2)


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """Inverse of unit lower triangular matrices L [..., C, C] (C a power of two), by block forward substitution.

    Starts from the 1x1 diagonal blocks and doubles: inv([[X, 0], [L21, Y]]) has blocks X^-1, Y^-1 and
    -Y^-1 L21 X^-1. Only batched matmuls: on CPU this beats a batched LAPACK triangular solve, whose per-matrix
    calls and layout copies dominate at C = 64, and its backward is plain matmuls too.
    """
    C = L.shape[-1]
    batch = L.shape[:-2]
    inv = torch.ones(*batch, C, 1, 1, dtype=L.dtype, device=L.device)  # [..., C/s, s, s] diagonal blocks
    size = 1
    while size < C:
        pairs = C // (2 * size)
        blocks = L.reshape(*batch, pairs, 2, size, pairs, 2, size)
        # below-diagonal block of each pair: rows of its second half, columns of its first half
        lower = torch.diagonal(blocks[..., :, 1, :, :, 0, :], dim1=-4, dim2=-2).movedim(-1, -3)  # [..., pairs, s, s]
        first, second = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        corner = -(second @ lower @ first)
        top = torch.cat([first, torch.zeros_like(first)], -1)
        inv = torch.cat([top, torch.cat([corner, second], -1)], -2)
        size *= 2
    return inv.reshape(*batch, C, C)


def _chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k, g [B, T, H, K] (q scaled), v [B, T, H, V], beta [B, T, H], h0 [B, H, K, V].

    Returns o [B, T, H, V] fp32 and the final state [B, H, K, V]. T is padded to a multiple of 64 with
    g = k = v = beta = 0, which leaves the state untouched, so the final state is exact.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0:
        return v.new_zeros(B, 0, H, V), h0
    pad = (-T) % CHUNK
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // CHUNK

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B, H, N, C, D]
        return x.transpose(1, 2).reshape(B, H, n, CHUNK, x.shape[-1])

    q, k, v, g = (chunked(x) for x in (q, k, v, g))
    beta = beta.transpose(1, 2).reshape(B, H, n, CHUNK, 1)
    # Cumulative sums restart every chunk: |G| stays small enough for fp32 differences to be accurate.
    G = g.cumsum(-2)
    M, Akk = _intra_chunk_scores(q, k, G)

    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    decay = _decay(G)  # [B, H, N, C, K], <= 1
    T_ut = _unit_lower_inverse(eye + Akk * beta) * beta.transpose(-1, -2)  # (I + A)^-1 diag(beta)
    U, W = T_ut @ v, T_ut @ (k * decay)

    last = G[..., -1:, :]  # [B, H, N, 1, K]
    k_to_end = k * _decay(last - G)  # decay from each token to the chunk end, <= 1
    q_read = q * decay - M @ W  # O = q_read S0 + M U
    MU = M @ U
    P = torch.diag_embed(_decay(last.squeeze(-2))) - k_to_end.transpose(-1, -2) @ W  # [B, H, N, K, K]
    R = k_to_end.transpose(-1, -2) @ U  # [B, H, N, K, V]

    states = []
    state = h0
    # unbind, not P[:, :, i]: the backward of one unbind is one stack, the backward of n selects is n full-size zeros.
    for P_i, R_i in zip(P.unbind(2), R.unbind(2)):
        states.append(state)
        state = torch.baddbmm(R_i.flatten(0, 1), P_i.flatten(0, 1), state.flatten(0, 1)).view_as(state)
    o = q_read @ torch.stack(states, dim=2) + MU  # [B, H, N, C, V]
    o = o.reshape(B, H, n * CHUNK, V).transpose(1, 2)[:, :T].contiguous()
    return o, state


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (chunk 64) in PyTorch; differentiable by autograd; any T (padded internally).

    q, k, g: [B, T, H, K] (g = log decay <= 0); v: [B, T, H, V]; beta: [B, T, H];
    initial_state: [N, H, K, V] fp32, N = B, or the number of sequences when cu_seqlens [N+1] packs them into B = 1.
    Returns o [B, T, H, V] in v's dtype and the fp32 final state [N, H, K, V] (None unless output_final_state).
    """
    return run_recurrence(_chunk_fwd, q, k, v, g, beta, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, cu_seqlens, kwargs, multiple=CHUNK)
