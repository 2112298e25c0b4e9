"""Step-by-step KDA in PyTorch: the decode path (one or a few tokens against a carried state).

Shape legend: B batch, T time, H heads, K key dim, V value dim, N packed sequences, L longest sequence.
"""

from __future__ import annotations

import torch

from k3.ops.kda.utils import apply_fla_kwargs, check_inputs, l2norm, pack_to_padded, padded_to_pack


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
    g, beta = apply_fla_kwargs(g, beta, kwargs)
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    K, V = q.shape[-1], v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, vf, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * scale
    mask = None
    if cu_seqlens is not None:
        (q, _), (k, _), (vf, _), (g, _), (beta, mask) = (pack_to_padded(x, cu_seqlens) for x in (q, k, vf, g, beta))
    B, _, H, _ = q.shape
    h0 = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    o, state = _recurrent_fwd(q, k, vf, g, beta, h0)
    if mask is not None:
        o = padded_to_pack(o, mask)
    return o.to(v.dtype), (state if output_final_state else None)
