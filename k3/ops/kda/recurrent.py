"""Step-by-step KDA in PyTorch: the decode path (one or a few tokens against a carried state).

Shape legend: B batch, T time, H heads, K key dim, V value dim, N packed sequences, L longest sequence.
"""

from __future__ import annotations

import torch

from k3.ops.kda.utils import run_recurrence


def _recurrent_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k, g [B, T, H, K] (q scaled), v [B, T, H, V], beta [B, T, H], state [B, H, K, V] -> (o, state)."""
    decay = g.exp()
    kb = k * beta[..., None]
    outs = []
    for t in range(q.shape[1]):
        state = state * decay[:, t, :, :, None]
        # delta rule against the decayed state: write beta * (v - S^T k) along k
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = torch.addcmul(state, kb[:, t, :, :, None], err[:, :, None, :])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, state


def fused_recurrent_kda_torch(
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
    """KDA one token at a time, vectorised over batch and heads; differentiable by autograd.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [N, H, K, V] fp32 (N = B, or the
    number of sequences when cu_seqlens [N+1] packs them into B = 1). Returns o [B, T, H, V] in v's dtype and
    the fp32 final state [N, H, K, V] (None unless output_final_state).
    """
    return run_recurrence(_recurrent_fwd, q, k, v, g, beta, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, cu_seqlens, kwargs)
