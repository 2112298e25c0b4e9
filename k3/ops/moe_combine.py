"""The MoE combine: each token's K routed-expert outputs summed with their gate weights.

    out[t, :] = sum_k w[t, k] * y[t, k, :]          y [T, K, L] (pair order), w [T, K] (fp32 gate weights)

Two interchangeable paths, held equal by tests/ops/test_moe_combine.py:
- `combine_pairs_bmm` (the twin; CPU, and inside torch.compile, where Inductor fuses it): one batched matmul of
  [T, 1, K] by [T, K, L], fp32 accumulation inside the matmul, no atomics;
- `combine_pairs_triton`: one Triton kernel forward and one backward (k3.ops.moe_triton_kernels). The batched
  matmul is T tiny products, which cuBLAS runs far from the memory floor: in a `small` training step on one H200
  (16,384 tokens, K 6, L 512) the forward and its two backward bmm (one a k=1 outer product per token) took
  12.8 ms of kernel time in 15 MoE layers, about 0.85 ms a layer, where the bytes take about 0.1 ms
  (bench/results/train_profile_small_round3_h200.txt). The kernels also keep the gate weights in fp32, where the
  bmm rounds them to y's dtype first.

- `combine_pairs_sum`: products and additions over K in fp32, for compiled inference. Inside torch.compile on a
  GPU the bmm stays a cuBLAS batched gemv of its own (`gemv2N_kernel`, 2.4 us a MoE layer in `small`'s batch-64
  decode step on one H200, and a cast of the gate weights before it, 1.2 us), where a sum over K is elementwise
  work that Inductor computes inside the kernel reading the result (the latent norm). Measured side by side on one
  H200, `small` at batch 64: 2.656 -> 2.583 ms a step, 369 -> 339 kernels (bench/results/decode_round13_h200/).

`K3_MOE_COMBINE=auto|bmm|triton|sum` forces one; auto takes Triton for CUDA tensors outside torch.compile, when
triton imports, the sum form inside torch.compile without autograd, else the bmm (compiled training keeps the bmm:
the sum form's backward is unmeasured). A Triton compile failure of an auto-selected kernel warns once and runs
the twin from then on.
Shape suffixes: T tokens, K routed experts per token, L expert output width.
"""

from __future__ import annotations

import os

import torch

from k3.ops.fused_backend import with_torch_fallback
from k3.ops.triton_support import interpreting, kernel_module, triton_importable

_BACKENDS = ("auto", "bmm", "triton", "sum")


def combine_backend() -> str:
    backend = os.environ.get("K3_MOE_COMBINE", "auto").strip().lower()
    if backend not in _BACKENDS:
        raise ValueError(f"K3_MOE_COMBINE={backend!r}; use one of {_BACKENDS}")
    return backend


def combine_pairs_bmm(y_TKL: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """The twin: a batched matmul in y's dtype (fp32 accumulation inside the matmul for bf16)."""
    return torch.bmm(weights_TK.to(y_TKL.dtype).unsqueeze(1), y_TKL).squeeze(1)


def combine_pairs_sum(y_TKL: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] y[t, k, :] in fp32 (the gate weights unrounded), in y's dtype, written as K - 1 additions:
    a sum over a dimension of K would be a reduction kernel of its own in Inductor, where additions stay
    elementwise and can be computed inside the kernel that reads the result (the latent MoE's norm)."""
    weights = weights_TK.float()
    out = y_TKL[:, 0].float() * weights[:, 0:1]
    for k in range(1, y_TKL.shape[1]):
        out = out + y_TKL[:, k].float() * weights[:, k:k + 1]
    return out.to(y_TKL.dtype)


def _kernels():
    return kernel_module("k3.ops.moe_triton_kernels", interpreting())


def _block_tokens(width: int) -> int:
    """Tokens per program: a tile of about 4K elements per expert slot (BLOCK_L is at most 512 wide)."""
    return max(1, min(16, 4096 // min(512, max(16, width))))


class _CombinePairs(torch.autograd.Function):
    @staticmethod
    def forward(y_TKL: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        import triton

        num_tokens, top_k, width = y_TKL.shape
        out_TL = y_TKL.new_empty(num_tokens, width)
        if num_tokens == 0 or width == 0:
            return out_TL
        block_l = min(512, triton.next_power_of_2(width))
        block_t = _block_tokens(width)
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_l))
        _kernels().combine_pairs_fwd[grid](y_TKL, weights_TK, out_TL, num_tokens, width, TOP_K=top_k,
                                           BLOCK_T=block_t, BLOCK_L=block_l)
        return out_TL

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_TL: torch.Tensor):
        import triton

        y_TKL, weights_TK = ctx.saved_tensors
        num_tokens, top_k, width = y_TKL.shape
        grad_TL = grad_TL.contiguous()
        grad_y = torch.empty_like(y_TKL)
        grad_w = torch.empty_like(weights_TK)
        if num_tokens and width:
            block_t = _block_tokens(width)
            _kernels().combine_pairs_bwd[(triton.cdiv(num_tokens, block_t),)](
                y_TKL, weights_TK, grad_TL, grad_y, grad_w, num_tokens, width, TOP_K=top_k,
                K_POW2=triton.next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_L=min(256, triton.next_power_of_2(width)))
        elif num_tokens:
            grad_w.zero_()
        return grad_y, grad_w


def combine_pairs_triton(y_TKL: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Same arguments and result as combine_pairs_bmm (the gate weights kept in their own precision), with a
    backward for both inputs."""
    return _CombinePairs.apply(y_TKL.contiguous(), weights_TK.contiguous())


def weighted_sum_over_k(y_TKL: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * y[t, k, :] -> [T, L] in y's dtype, deterministic (no scatter-add of pairs into
    tokens) and without an fp32 copy of the [T, K, L] pair outputs; the path K3_MOE_COMBINE picks."""
    backend = combine_backend()
    if backend == "triton":
        return combine_pairs_triton(y_TKL, weights_TK)
    if backend == "sum" or (backend == "auto" and torch.compiler.is_compiling() and not torch.is_grad_enabled()):
        return combine_pairs_sum(y_TKL, weights_TK)
    if backend == "auto" and y_TKL.is_cuda and not torch.compiler.is_compiling() and triton_importable():
        variant = ("moe_combine_triton", y_TKL.shape[1], y_TKL.dtype, weights_TK.dtype)
        return with_torch_fallback(variant, lambda: combine_pairs_triton(y_TKL, weights_TK),
                                   lambda: combine_pairs_bmm(y_TKL, weights_TK))
    return combine_pairs_bmm(y_TKL, weights_TK)
