"""The router's gate weights for training, from the logits and the chosen experts, as one Triton kernel forward and
one backward (k3.ops.route_weights_kernels).

    s = sigmoid(logits)[ids]              (fp32; the selection's scores come from the caller's own sigmoid)
    w = s / (sum_k s + 1e-20) * scale     (renormalised when the config says so)

Why: k3.layers.moe.Router's training forward wrote this as a gather, a sum, an add, a division and a product
(5 launches after the sigmoid), and autograd ran 11 more backward (the product's, 7 for the division and the
sum, a zeros + scatter_add for the gather, the sigmoid's): 16 launches per MoE layer, most of the routing's
small kernels in the CPU census of a `small` step (docs/history/benchmarks.md, "where the step's small kernels
come from"). The forward kernel gathers the chosen logits and writes the weights and the chosen s (fp32, saved
for the backward); the backward kernel writes d_logits [T, E] whole: zeros off the chosen experts, the
renormalisation's Jacobian and s (1 - s) on them.

The twin is route_weights_torch, the ops the router always ran, on the caller's scores. The kernels compute in
fp32 and sum over k in their own order, so the two differ in the last bits. Under the switch `route_weights`
(K3_ROUTE_WEIGHTS, k3.kernels) = "triton" the kernels run for CUDA tensors (CPU tensors in Triton's interpreter),
outside torch.compile (a compiled graph fuses the twin's ops itself); "torch", the default, keeps the twin.
Neither kernel syncs with the host or allocates by data, so the training step can be captured in a CUDA graph.
tests/ops/test_route_weights_triton.py holds the kernels to an fp64 oracle and to the twin.

Shape suffixes: T tokens, E experts, K picks per token.
"""

from __future__ import annotations

import torch

from k3 import kernels
from k3.ops.triton_support import interpreting, kernel_module, runs_kernels_on, triton_importable

# Not swept (not yet timed): the forward holds [FORWARD_BLOCK_T, K] pairs a program (128 programs for `small`'s
# 16,384 tokens); the backward [BLOCK_T, E] values of d_logits, E rounded up to a power of two, about TILE of them
# (QB's top-k tile): 32 tokens a program at 64 experts, 2 at K3's 896.
FORWARD_BLOCK_T = 128
TILE = 2048
RENORMALIZE_EPS = 1e-20


def route_weights_backend() -> str:
    """The switch `route_weights` (K3_ROUTE_WEIGHTS): "triton" or "torch"."""
    return kernels.choice("route_weights")


def triton_chosen(logits_TE: torch.Tensor) -> bool:
    """Whether the kernels run for these logits: chosen, outside torch.compile, on CUDA or in Triton's CPU
    interpreter."""
    if route_weights_backend() != "triton" or torch.compiler.is_compiling() or not triton_importable():
        return False
    return runs_kernels_on(logits_TE.device)


def route_weights_torch(scores_TE: torch.Tensor, ids_TK: torch.Tensor, renormalize: bool,
                        scale: float) -> torch.Tensor:
    """The twin: scores [T, E] (the sigmoid of the logits), ids [T, K] -> weights [T, K] in the scores' dtype."""
    weights_TK = scores_TE.gather(1, ids_TK)
    if renormalize:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + RENORMALIZE_EPS)
    return weights_TK * scale


def _block_t(num_experts: int) -> int:
    """Tokens a backward program writes d_logits for."""
    import triton

    return max(1, TILE // triton.next_power_of_2(num_experts))


def _check(logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> None:
    if logits_TE.dim() != 2 or not logits_TE.is_floating_point():
        raise ValueError(f"logits must be a float [T, E] tensor, got {logits_TE.dtype} {tuple(logits_TE.shape)}")
    if ids_TK.dim() != 2 or ids_TK.shape[0] != logits_TE.shape[0] or ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64 [T, K] with T = {logits_TE.shape[0]} (the logits' rows), got "
                         f"{ids_TK.dtype} {tuple(ids_TK.shape)}")
    if ids_TK.device != logits_TE.device:
        raise ValueError(f"ids on {ids_TK.device}, logits on {logits_TE.device}: put them on one device")


class _RouteWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE: torch.Tensor, ids_TK: torch.Tensor, renormalize: bool,
                scale: float) -> torch.Tensor:
        import triton

        num_tokens, num_experts = logits_TE.shape
        top_k = ids_TK.shape[1]
        weights_TK = torch.empty(num_tokens, top_k, dtype=logits_TE.dtype, device=logits_TE.device)
        chosen_TK = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits_TE.device)
        if num_tokens and top_k:
            kernel_module("k3.ops.route_weights_kernels", interpreting()).route_weights_forward[
                (triton.cdiv(num_tokens, FORWARD_BLOCK_T),)](
                logits_TE, ids_TK, weights_TK, chosen_TK, num_tokens, num_experts, logits_TE.stride(0),
                logits_TE.stride(1), ids_TK.stride(0), ids_TK.stride(1), float(scale), TOP_K=top_k,
                K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=bool(renormalize), BLOCK_T=FORWARD_BLOCK_T)
        ctx.save_for_backward(ids_TK, chosen_TK)
        ctx.shape, ctx.dtype, ctx.renormalize, ctx.scale = logits_TE.shape, logits_TE.dtype, renormalize, scale
        return weights_TK

    @staticmethod
    def backward(ctx, grad_TK: torch.Tensor):
        import triton

        ids_TK, chosen_TK = ctx.saved_tensors
        num_tokens, num_experts = ctx.shape
        top_k = ids_TK.shape[1]
        grad_TE = torch.empty(num_tokens, num_experts, dtype=ctx.dtype, device=grad_TK.device)
        if num_tokens and num_experts:
            block_t = _block_t(num_experts)
            kernel_module("k3.ops.route_weights_kernels", interpreting()).route_weights_backward[
                (triton.cdiv(num_tokens, block_t),)](
                grad_TK, ids_TK, chosen_TK, grad_TE, num_tokens, num_experts, grad_TK.stride(0), grad_TK.stride(1),
                ids_TK.stride(0), ids_TK.stride(1), float(ctx.scale), TOP_K=top_k,
                K_POW2=triton.next_power_of_2(max(top_k, 1)), EXPERTS_POW2=triton.next_power_of_2(num_experts),
                RENORMALIZE=bool(ctx.renormalize), BLOCK_T=block_t)
        return grad_TE, None, None, None


def route_weights_triton(logits_TE: torch.Tensor, ids_TK: torch.Tensor, renormalize: bool,
                         scale: float) -> torch.Tensor:
    """logits [T, E] (any float dtype, any strides), ids [T, K] int64 or int32 -> weights [T, K] in the logits'
    dtype, differentiable in the logits (d_logits [T, E] contiguous, in their dtype). An id outside 0..E-1 is not
    read (the twin's gather raises on it): it gets a weight of 0 and no gradient."""
    _check(logits_TE, ids_TK)
    return _RouteWeights.apply(logits_TE, ids_TK, renormalize, scale)
