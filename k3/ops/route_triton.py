"""The sigmoid router of a decode step after its GEMM, as one Triton kernel (k3.ops.moe_triton_kernels.route_topk).

    logits = x W^T            (fp32, torch's matmul: the very logits of the eager router)
    scores = sigmoid(logits)
    ids    = topk(scores + b, k)       by k rounds of argmax, lowest expert id on a tie
    w      = scores[ids] / sum * scale (renormalised when the config says so)

Why: after its GEMM the eager router of one MoE layer is the sigmoid and bias, torch.topk, a gather and the
renormalisation, five or six launches (torch.topk alone 4.8 us per layer at batch 1 in `small`'s compiled decode
step on one H200), in a step that is launch-bound. The kernel reads the [T, E] logits once.
A first version also did the GEMM, with one program per 16 tokens looping over the hidden width: at batch 1 its
single program waited on 16 dependent loads, and the compiled step got slower by 0.36 ms (2.09 -> 2.45 ms). The
GEMM stays with cuBLAS.

The PyTorch twin is k3.layers.moe.Router's own forward, held equal by tests/ops/test_route_triton.py (through
Triton's CPU interpreter without a GPU). Under torch.compile the launcher is the custom op `k3::moe_route_triton`.
`K3_ROUTER_BACKEND=auto|torch|triton`: auto takes the kernel for inference on CUDA up to TRITON_MAX_ROWS tokens.
"""

from __future__ import annotations

import torch

from k3.ops.moe_triton import TRITON_MAX_ROWS, kernels
from k3.ops.triton_support import interpreting, kernel_backend, triton_importable

_ENV = "K3_ROUTER_BACKEND"
# Tokens per program and warps: 4 tokens on 2 warps took 2.6 us per layer against 3.3 for 16 on 4 (Triton's
# default warps) at 1, 8 and 64 tokens on one H200 (bench/moe_decode.py --router); 1 warp was slower.
BLOCK_T = 4
NUM_WARPS = 2


def router_backend() -> str:
    return kernel_backend(_ENV)


def check_selection(bias_E: torch.Tensor, num_experts: int, k: int, what: str, k_name: str = "k") -> None:
    """A top-k over `what` [T, E] with a bias [E]: the bias must have E entries and k (called `k_name` in the
    caller's signature) lie in 1..E."""
    if bias_E.shape != (num_experts,):
        raise ValueError(f"bias {tuple(bias_E.shape)} does not fit {what} over {num_experts} experts: expected "
                         f"[{num_experts}]")
    if not 0 < k <= num_experts:
        raise ValueError(f"{k_name}={k} must lie in 1..{num_experts} (the number of experts)")


def route_triton_eager(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, renormalize: bool,
                       scale: float, block_t: int = BLOCK_T,
                       num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (fp32: x.float() @ W.float().t(), computed by the caller so that a compiled step fuses
    the casts), bias [E] -> (ids [T, K] int64, weights [T, K] fp32, scores [T, E] fp32). block_t and num_warps
    are the benchmark's to sweep."""
    import triton

    num_tokens, num_experts = logits_TE.shape
    check_selection(bias_E, num_experts, top_k, "logits", "top_k")
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits_TE.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits_TE.device)
    scores = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=logits_TE.device)
    if num_tokens == 0:
        return ids, weights, scores
    kernels(interpreting()).route_topk[(triton.cdiv(num_tokens, block_t),)](
        logits_TE, bias_E, ids, weights, scores, num_tokens, logits_TE.stride(0), logits_TE.stride(1), float(scale),
        NUM_EXPERTS=num_experts, EXPERTS_POW2=triton.next_power_of_2(num_experts), TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=bool(renormalize), BLOCK_T=block_t, num_warps=num_warps)
    return ids, weights, scores


@torch.library.custom_op("k3::moe_route_triton", mutates_args=())
def moe_route_op(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, renormalize: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return route_triton_eager(logits_TE, bias_E, top_k, renormalize, scale)


@moe_route_op.register_fake
def _(logits_TE, bias_E, top_k, renormalize, scale):
    num_tokens, num_experts = logits_TE.shape
    return (logits_TE.new_empty(num_tokens, top_k, dtype=torch.int64),
            logits_TE.new_empty(num_tokens, top_k, dtype=torch.float32),
            logits_TE.new_empty(num_tokens, num_experts, dtype=torch.float32))


def route_triton(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, renormalize: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route_triton_eager, as one opaque op under torch.compile. Inference only (no backward)."""
    if torch.compiler.is_compiling():
        return moe_route_op(logits_TE.float(), bias_E, top_k, renormalize, scale)
    return route_triton_eager(logits_TE.float(), bias_E, top_k, renormalize, scale)


def route_triton_pays(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> bool:
    """Whether the router runs the kernel: never under autograd (it has no backward); else when forced by
    K3_ROUTER_BACKEND=triton, or with auto on CUDA up to TRITON_MAX_ROWS tokens."""
    backend = router_backend()
    if torch.is_grad_enabled() and (x_TD.requires_grad or weight_ED.requires_grad):
        return False  # forced or not: the router's gradient needs the PyTorch forward
    if backend != "auto":
        return backend == "triton"
    return x_TD.is_cuda and x_TD.shape[0] <= TRITON_MAX_ROWS and triton_importable()
