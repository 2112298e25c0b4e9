"""Shared helpers of the KDA PyTorch paths: argument checks, L2 norm, gate, packed-sequence layout, and the frame
(fp32 inputs, padded rows, output back in v's dtype) that the chunked and the step-by-step paths run in.

Shape legend: B batch, T time, H heads, K key dim, V value dim, N number of packed sequences,
L longest packed sequence (padded).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6

# fla keyword arguments that only steer its kernels (recompute, CPU copy of cu_seqlens, ...):
# they do not change the result, so the PyTorch paths accept and ignore them.
_IGNORED_KWARGS = frozenset({"cu_seqlens_cpu", "disable_recompute", "safe_gate", "chunk_size", "cp_context",
                             "use_graph", "max_num_seqs"})


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32. x: [..., K] -> [..., K] fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(
    raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Log decay g from the low-rank gate projection, in fp32.

    raw: [B, T, H, K]; A_log: [H] or longer (the first H entries are used); dt_bias: [H*K], [H, K], [H] or None.
    lower_bound None: Kimi Linear form g = -exp(A_log[h]) * softplus(raw + dt_bias), g in (-inf, 0).
    lower_bound lb:   K3 form g = lb * sigmoid(exp(A_log[h]) * (raw + dt_bias)), g in (lb, 0).
    Returns g: [B, T, H, K] fp32.
    """
    H, K = raw.shape[-2], raw.shape[-1]
    if A_log.numel() < H:
        raise ValueError(f"A_log has {A_log.numel()} entries, need at least one per head (H={H})")
    a = A_log.reshape(-1)[:H].float().exp().view(H, 1)
    x = raw.float()
    if dt_bias is not None:
        if dt_bias.numel() == H * K:
            x = x + dt_bias.float().reshape(H, K)
        elif dt_bias.numel() == H:
            x = x + dt_bias.float().reshape(H, 1)
        else:
            raise ValueError(f"dt_bias must have H*K={H * K} (per channel) or H={H} entries, got shape {tuple(dt_bias.shape)}")
    if lower_bound is None:
        return -a * F.softplus(x)
    if lower_bound >= 0:
        raise ValueError(f"lower_bound is a log decay bound and must be negative, got {lower_bound}")
    return lower_bound * torch.sigmoid(a * x)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> None:
    """Raise a ValueError naming the first argument whose shape breaks the fla convention."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must be [B, T, H, K] = {tuple(q.shape)} (per-channel log decay), got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (packed sequences), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}], got {tuple(initial_state.shape)}")


def apply_fla_kwargs(g: torch.Tensor, beta: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Honour fla's in-kernel gate/beta options on the PyTorch paths so that a drop-in call means the same.

    use_gate_in_kernel (+ A_log, dt_bias, lower_bound): g is the raw gate projection, turned into the log decay here.
    use_beta_sigmoid_in_kernel (+ allow_neg_eigval): beta holds logits.
    Any other keyword that would change the result raises a TypeError instead of being silently dropped.
    """
    kwargs = dict(kwargs)
    use_gate = kwargs.pop("use_gate_in_kernel", False)
    A_log = kwargs.pop("A_log", None)
    dt_bias = kwargs.pop("dt_bias", None)
    lower_bound = kwargs.pop("lower_bound", None)
    beta_sigmoid = kwargs.pop("use_beta_sigmoid_in_kernel", False)
    neg_eig = kwargs.pop("allow_neg_eigval", False)
    for name in ("state_v_first", "transpose_state_layout", "return_intermediate_states"):
        if kwargs.pop(name, False):
            raise TypeError(f"{name}=True is not supported by the PyTorch KDA path")
    unknown = set(kwargs) - _IGNORED_KWARGS
    if unknown:
        raise TypeError(f"unexpected keyword arguments for KDA: {sorted(unknown)}")
    if use_gate:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log")
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if beta_sigmoid:
        beta = torch.sigmoid(beta.float()) * (2.0 if neg_eig else 1.0)
    elif neg_eig:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    return g, beta


def pack_to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [1, T, ...] -> padded [N, L, ...] with zeros after each sequence's end, and the validity mask [N, L].

    Zero padding at the end of a sequence is neutral for KDA (g=0 keeps the state, k=0 writes nothing), so the
    final state of a padded row is the sequence's final state. L is rounded up to `multiple`.
    """
    bounds = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    if min(lens) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    L = max(max(lens), 1)
    L = -(-L // multiple) * multiple
    t = torch.arange(L, device=x.device)
    starts = torch.tensor(bounds[:-1], device=x.device)
    mask = t[None, :] < torch.tensor(lens, device=x.device)[:, None]
    idx = (starts[:, None] + t[None, :]).clamp(max=max(x.shape[1] - 1, 0))
    padded = x[0][idx]
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    padded = torch.where(mask.view(*mask.shape, *([1] * (padded.dim() - 2))), padded, zero)
    return padded, mask


def padded_to_pack(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Padded [N, L, ...] -> packed [1, T, ...], keeping the positions where mask [N, L] is True (in order)."""
    return x[mask].unsqueeze(0)


def fp32_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: float | None, use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta) in fp32 with q scaled by `scale` (None: K**-0.5), q and k L2-normalised over K first when
    use_qk_l2norm_in_kernel. Shapes unchanged."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    return q * scale, k, v, g, beta


def run_recurrence(
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None,
    kwargs: dict,
    multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A PyTorch KDA path in fla's convention around `forward`, which runs the recurrence on padded fp32 rows:
    forward(q, k, v, g, beta, h0) with q, k, g [B, T, H, K] (q scaled), v [B, T, H, V], beta [B, T, H],
    h0 [B, H, K, V] -> (o [B, T, H, V], final state [B, H, K, V]).

    Here: fla's keywords (apply_fla_kwargs), the shape checks, fp32_inputs; packed sequences (cu_seqlens) become
    one zero-padded row each, of a whole number of `multiple` tokens, and o is packed back. Returns o in v's dtype
    and the fp32 final state [N, H, K, V] (None unless output_final_state).
    """
    g, beta = apply_fla_kwargs(g, beta, kwargs)
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    qf, kf, vf, gf, betaf = fp32_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    mask = None
    if cu_seqlens is not None:
        # Each sequence becomes one batch row, zero-padded: no state crosses a boundary.
        (qf, _), (kf, _), (vf, _), (gf, _), (betaf, mask) = (
            pack_to_padded(x, cu_seqlens, multiple) for x in (qf, kf, vf, gf, betaf)
        )
    B, _, H, K = qf.shape
    h0 = qf.new_zeros(B, H, K, vf.shape[-1]) if initial_state is None else initial_state.float()
    o, state = forward(qf, kf, vf, gf, betaf, h0)
    if mask is not None:
        o = padded_to_pack(o, mask)
    return o.to(v.dtype), (state if output_final_state else None)
