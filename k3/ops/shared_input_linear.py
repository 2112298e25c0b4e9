"""Several projections of one input in training: one GEMM forward, one accumulating dgrad chain backward.

    y_i = x @ W_i^T                         (forward: x @ cat(W_i)^T, the outputs column slices of one tensor)
    dx  = sum_i dy_i @ W_i                  (backward: the first a GEMM, the rest added by cuBLAS into it)
    dW_i = dy_i^T @ x

Why: left to autograd, projections that read one tensor (a latent MoE's down projection and its shared
expert's gate and up; a GLU MLP's gate and up) each return their own dx, and autograd adds them: at `small`'s
training shape ([16384, 1024] bf16) each addition reads two such tensors and writes one (96 MB). Joining the
weights per forward and letting autograd split the output (k3.layers.kda's input projections) instead copies the
outputs' gradients into one tensor for a single dgrad GEMM: 2 * T * sum(widths) of traffic. Here each dgrad
after the first is `addmm_` into dx (beta = 1: cuBLAS reads dx in its epilogue and rounds the sum once), which
costs 2 * T * D per extra projection and no copy. The forward keeps the one GEMM over the joined weights (a
few MB copied per step), whose wider output runs at a better rate than two or three narrow GEMMs.

The PyTorch twin is a plain F.linear per weight (`linears_of_one_input_twin`), held equal by
tests/ops/test_shared_input_linear.py.
Shape suffixes: T rows (any leading dims flattened), D input width, O_i output widths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3 import kernels

# Training calls over at least this many tokens run projections that share their input as one GEMM with an
# accumulating backward; fewer tokens (decode-sized) keep one GEMM per projection.
JOIN_MIN_TOKENS = 17


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear of x in (None when autocast is off on x's device)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def joins_projections(x: torch.Tensor, projections: tuple[nn.Linear, ...] | list[nn.Linear] = (),
                      others: tuple[nn.Module, ...] = ()) -> bool:
    """Whether a layer should run `projections` of x through linears_of_one_input: gradients on, many tokens,
    no bias, weights on x's device in x's dtype (or floating point of any width under autocast, which casts
    them as F.linear would), and no hooks on them or on `others` (a hook must see its module run).
    K3_JOIN_PROJECTIONS=0 turns it off."""
    if not (torch.is_grad_enabled() and x.numel() >= JOIN_MIN_TOKENS * x.shape[-1]
            and kernels.enabled("join_projections")):
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in (*projections, *others)):
        return False
    cast = autocast_dtype(x) if x.is_floating_point() else None
    return all(p.bias is None and p.weight.device == x.device
               and (p.weight.dtype == x.dtype or (cast is not None and p.weight.is_floating_point()))
               for p in projections)


def linears_of_one_input_twin(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [F.linear(x, w) for w in weights]


class _SharedInputLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        joined = torch.cat(weights, dim=0) if len(weights) > 1 else weights[0]
        y = F.linear(x, joined)
        ctx.save_for_backward(x, *weights)
        # Column slices of the one output: consumers read them through their row strides (the GLU kernels, the
        # expert gathers) or copy them if they must.
        return tuple(y.split([w.shape[0] for w in weights], dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        x_TD = x.reshape(-1, x.shape[-1])
        dx_TD = None
        dweights = []
        for g, w, needed in zip(grads, weights, ctx.needs_input_grad[1:]):
            if g is None:  # an output no loss reached
                dweights.append(None)
                continue
            g_TO = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:
                if dx_TD is None:
                    dx_TD = g_TO @ w
                else:
                    dx_TD.addmm_(g_TO, w)
            dweights.append((g_TO.t() @ x_TD) if needed else None)
        dx = dx_TD.view(x.shape) if dx_TD is not None else None
        return dx, *dweights


def linears_of_one_input(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[x @ W^T for W in weights], [..., D] -> [..., O_i] each; every weight [O_i, D] in x's dtype. With
    gradients on, the one-GEMM forward and the accumulating backward above; without, the same single GEMM.
    Under autocast x and the weights are first cast to its dtype, as autocast casts F.linear's inputs (the
    trainer's bf16 autocast over fp32 weights: the fp32 gradients come back through those casts)."""
    if not weights:
        raise ValueError("linears_of_one_input needs at least one weight")
    cast = autocast_dtype(x) if x.is_floating_point() else None
    if cast is not None:
        x = x.to(cast)
        weights = [w.to(cast) if w.is_floating_point() else w for w in weights]
        with torch.autocast(x.device.type, enabled=False):
            return linears_of_one_input(x, weights)
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != x.shape[-1] or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"weight {i} is {tuple(w.shape)} {w.dtype} on {w.device}; each must be [out, "
                             f"{x.shape[-1]}] {x.dtype} on {x.device}, like x [..., {x.shape[-1]}]")
    return list(_SharedInputLinear.apply(x, *weights))
