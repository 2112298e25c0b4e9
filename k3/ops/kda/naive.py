"""The plain fp32 KDA loop: one token at a time, exactly the recurrence of SPEC section 3. Used as the test oracle.

Shape legend: B batch, T time, H heads, K key dim, V value dim, N packed sequences.
"""

from __future__ import annotations

import torch

from k3.ops.kda.utils import check_inputs, fp32_inputs


def _naive_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k, g [B, T, H, K] (q already scaled), v [B, T, H, V], beta [B, T, H], state [B, H, K, V]."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None]
        k_t = k[:, t]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, state


def naive_recurrent_kda(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA: S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T (scale q_t).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [N, H, K, V] (N = B, or the number of
    sequences in cu_seqlens [N+1] with B = 1). Returns o [B, T, H, V] in v's dtype and the fp32 final state
    [N, H, K, V] (None unless output_final_state). Everything runs in fp32, one token at a time.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, vf, g, beta = fp32_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    if cu_seqlens is None:
        h0 = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
        o, state = _naive_one(q, k, vf, g, beta, h0)
    else:
        bounds = cu_seqlens.tolist()
        outs, states = [], []
        for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            h0 = q.new_zeros(1, H, K, V) if initial_state is None else initial_state[n : n + 1].float()
            o_n, s_n = _naive_one(q[:, s:e], k[:, s:e], vf[:, s:e], g[:, s:e], beta[:, s:e], h0)
            outs.append(o_n)
            states.append(s_n)
        o, state = torch.cat(outs, dim=1), torch.cat(states, dim=0)
    return o.to(v.dtype), (state if output_final_state else None)
