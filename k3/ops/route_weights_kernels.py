"""The Triton kernels behind k3.ops.route_weights (see there); a module of its own because it imports triton."""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting
from k3.ops.triton_support import kernel_module

# Whether this import decorated the kernels for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = triton_interpreting()
_cast = kernel_module("k3.ops.triton_cast", INTERPRETED).cast_rounded


@triton.jit
def route_weights_forward(logits_ptr, ids_ptr, weights_ptr, chosen_ptr, num_tokens, num_experts, stride_lt,
                          stride_le, stride_it, stride_ik, scale, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                          RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    """For BLOCK_T tokens: s = sigmoid(logits[t, ids[t, k]]) in fp32, w = s (renormalised over k) * scale.
    Writes weights [T, K] (contiguous, in its pointer's dtype) and s [T, K] fp32 (contiguous, for the backward).
    An id outside 0..E-1 reads no memory and counts as a score of 0."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, K_POW2)
    ok = (tokens < num_tokens)[:, None] & (slots < TOP_K)[None, :]
    rows = tokens[:, None].to(tl.int64)
    ids = tl.load(ids_ptr + rows * stride_it + slots[None, :] * stride_ik, mask=ok, other=0)
    valid = ok & (ids >= 0) & (ids < num_experts)
    logits = tl.load(logits_ptr + rows * stride_lt + ids * stride_le, mask=valid, other=0.0).to(tl.float32)
    chosen = tl.where(valid, tl.sigmoid(logits), 0.0)
    weights = chosen
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scale
    pair = rows * TOP_K + slots[None, :]
    tl.store(weights_ptr + pair, _cast(weights, weights_ptr.dtype.element_ty), mask=ok)
    tl.store(chosen_ptr + pair, chosen, mask=ok)


@triton.jit
def route_weights_backward(grad_ptr, ids_ptr, chosen_ptr, dlogits_ptr, num_tokens, num_experts, stride_gt,
                           stride_gk, stride_it, stride_ik, scale, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                           EXPERTS_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    """For BLOCK_T tokens, every column of d_logits [T, E] (contiguous, in its pointer's dtype): on a chosen
    expert the weights' gradient through scale, the renormalisation's Jacobian and the sigmoid's s (1 - s); 0
    elsewhere. An expert chosen twice in a row gets the sum of its pairs' gradients (as a gather's backward)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    slots = tl.arange(0, K_POW2)
    ok = t_ok[:, None] & (slots < TOP_K)[None, :]
    rows = tokens[:, None].to(tl.int64)
    ids = tl.load(ids_ptr + rows * stride_it + slots[None, :] * stride_ik, mask=ok, other=-1)
    ids = tl.where(ok & (ids >= 0) & (ids < num_experts), ids, -1)
    grad = tl.load(grad_ptr + rows * stride_gt + slots[None, :] * stride_gk, mask=ok, other=0.0).to(tl.float32)
    chosen = tl.load(chosen_ptr + rows * TOP_K + slots[None, :], mask=ok, other=0.0)
    grad = grad * scale
    if RENORMALIZE:  # w = s / (S + eps): dw/ds_j = 1 / (S + eps) - sum_k g_k s_k / (S + eps)^2
        denominator = tl.sum(chosen, axis=1)[:, None] + 1e-20
        d_chosen = grad / denominator - tl.sum(grad * chosen, axis=1)[:, None] / (denominator * denominator)
    else:
        d_chosen = grad
    d_logit = d_chosen * (1.0 - chosen) * chosen
    experts = tl.arange(0, EXPERTS_POW2)
    dense = tl.zeros((BLOCK_T, EXPERTS_POW2), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # one pick at a time: a [T, E] tile, never [T, K, E]
        pick = tl.sum(tl.where(slots[None, :] == j, ids, 0), axis=1)
        value = tl.sum(tl.where(slots[None, :] == j, d_logit, 0.0), axis=1)
        dense += tl.where(experts[None, :] == pick[:, None], value[:, None], 0.0)
    tl.store(dlogits_ptr + rows * num_experts + experts[None, :], _cast(dense, dlogits_ptr.dtype.element_ty),
             mask=t_ok[:, None] & (experts < num_experts)[None, :])
