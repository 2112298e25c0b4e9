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

Expert order. The sorted path (k3.ops.moe) runs the experts on rows sorted by expert, y_NL [N, L], and the pairs
of token t sit at rows inverse_N[t * K + k]. Putting them back in pair order and then combining them cost, per MoE
layer of that `small` step, a [98,304, 512] bf16 row gather forward and another backward (~61 us each), and
gather_pairs' backward (the sum of each token's K rows) a third gather and a sum over K (61 + 56 us).
`combine_from_expert_order_triton` reads the expert-order rows through the inverse in the combine's own kernels
(forward out[t] = sum_k w[t, k] y[inverse[t * K + k]]; backward dy written straight into expert order, each row
once, and dw), and `sum_pairs_from_expert_order_triton` is gather_pairs' backward as one kernel (the forward
kernel with unit weights). Their twins, and the switch between the two, are in k3.ops.moe (they use its
permutations).

`K3_MOE_COMBINE=auto|torch|triton|sum` forces one (torch: the bmm; `bmm` is its old name); auto takes Triton for CUDA tensors outside torch.compile, when
triton imports, the sum form inside torch.compile without autograd, else the bmm (compiled training keeps the bmm:
the sum form's backward is unmeasured). The expert-order kernels follow the same switch: Triton where auto or
triton takes the combine kernels, the twin otherwise (torch, sum). A Triton compile failure of an auto-selected
kernel warns once and runs the twin from then on.
Shape suffixes: T tokens, K routed experts per token, L expert output width, N = T * K routed pairs.
"""

from __future__ import annotations

import torch

from k3 import kernels
from k3.ops.fused_backend import with_torch_fallback
from k3.ops.triton_support import interpreting, kernel_module, triton_importable

def combine_backend() -> str:
    return kernels.choice("moe_combine")


def auto_takes_triton(x: torch.Tensor) -> bool:
    """Whether K3_MOE_COMBINE=auto picks the Triton kernels for a combine over x: CUDA, eager, triton imports."""
    return (combine_backend() == "auto" and x.is_cuda and not torch.compiler.is_compiling()
            and triton_importable())


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


def _forward_tiles(num_tokens: int, width: int) -> tuple[tuple[int, int], dict[str, int]]:
    """Grid and tile sizes of a forward combine kernel (pair or expert order): BLOCK_T tokens by BLOCK_L columns a
    program."""
    import triton

    block_t, block_l = _block_tokens(width), min(512, triton.next_power_of_2(width))
    return (triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_l)), {"BLOCK_T": block_t, "BLOCK_L": block_l}


def _backward_tiles(num_tokens: int, width: int, top_k: int) -> tuple[tuple[int], dict[str, int]]:
    """Grid and tile sizes of a backward combine kernel: BLOCK_T tokens over the whole width a program, BLOCK_L
    columns at a time (dw needs no reduction across programs)."""
    import triton

    block_t = _block_tokens(width)
    return (triton.cdiv(num_tokens, block_t),), {"K_POW2": triton.next_power_of_2(top_k), "BLOCK_T": block_t,
                                                 "BLOCK_L": min(256, triton.next_power_of_2(width))}


class _CombinePairs(torch.autograd.Function):
    @staticmethod
    def forward(y_TKL: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k, width = y_TKL.shape
        out_TL = y_TKL.new_empty(num_tokens, width)
        if num_tokens == 0 or width == 0:
            return out_TL
        grid, tiles = _forward_tiles(num_tokens, width)
        _kernels().combine_pairs_fwd[grid](y_TKL, weights_TK, out_TL, num_tokens, width, TOP_K=top_k, **tiles)
        return out_TL

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_TL: torch.Tensor):
        y_TKL, weights_TK = ctx.saved_tensors
        num_tokens, top_k, width = y_TKL.shape
        grad_TL = grad_TL.contiguous()
        grad_y = torch.empty_like(y_TKL)
        grad_w = torch.empty_like(weights_TK)
        if num_tokens and width:
            grid, tiles = _backward_tiles(num_tokens, width, top_k)
            _kernels().combine_pairs_bwd[grid](y_TKL, weights_TK, grad_TL, grad_y, grad_w, num_tokens, width,
                                               TOP_K=top_k, **tiles)
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
    if auto_takes_triton(y_TKL):
        variant = ("moe_combine_triton", y_TKL.shape[1], y_TKL.dtype, weights_TK.dtype)
        return with_torch_fallback(variant, lambda: combine_pairs_triton(y_TKL, weights_TK),
                                   lambda: combine_pairs_bmm(y_TKL, weights_TK))
    return combine_pairs_bmm(y_TKL, weights_TK)


def _permute_kernels():
    return kernel_module("k3.ops.moe_permute_kernels", interpreting())


def _check_pairs(rows_NL: torch.Tensor, inverse_N: torch.Tensor, num_tokens: int, top_k: int) -> None:
    if rows_NL.dim() != 2 or inverse_N.shape != (rows_NL.shape[0],) or rows_NL.shape[0] != num_tokens * top_k:
        raise ValueError(f"expert-order rows [N, L] with inverse [N], N = tokens * top_k = {num_tokens} * {top_k}; "
                         f"got rows {tuple(rows_NL.shape)} and inverse {tuple(inverse_N.shape)}")


def _launch_expert_order_fwd(rows_NL: torch.Tensor, inverse_N: torch.Tensor, weights_TK: torch.Tensor | None,
                             num_tokens: int, top_k: int) -> torch.Tensor:
    width = rows_NL.shape[1]
    out_TL = rows_NL.new_empty(num_tokens, width)
    if num_tokens == 0 or width == 0:
        return out_TL
    grid, tiles = _forward_tiles(num_tokens, width)
    weighted = weights_TK is not None
    _permute_kernels().combine_expert_order_fwd[grid](
        rows_NL, inverse_N, weights_TK if weighted else rows_NL, out_TL, num_tokens, width, TOP_K=top_k,
        WEIGHTED=weighted, **tiles)
    return out_TL


class _CombineFromExpertOrder(torch.autograd.Function):
    @staticmethod
    def forward(y_NL: torch.Tensor, inverse_N: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return _launch_expert_order_fwd(y_NL, inverse_N, weights_TK, *weights_TK.shape)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_TL: torch.Tensor):
        y_NL, inverse_N, weights_TK = ctx.saved_tensors
        num_tokens, top_k = weights_TK.shape
        width = y_NL.shape[1]
        grad_TL = grad_TL.contiguous()
        grad_y = torch.empty_like(y_NL)  # every row written once: inverse_N is a permutation
        grad_w = torch.empty_like(weights_TK)
        if num_tokens and width:
            grid, tiles = _backward_tiles(num_tokens, width, top_k)
            _permute_kernels().combine_expert_order_bwd[grid](
                y_NL, inverse_N, weights_TK, grad_TL, grad_y, grad_w, num_tokens, width, TOP_K=top_k, **tiles)
        elif num_tokens:
            grad_w.zero_()
        return grad_y, None, grad_w


def combine_from_expert_order_triton(y_NL: torch.Tensor, inverse_N: torch.Tensor,
                                     weights_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y_NL[inverse_N[t * K + k]] -> [T, L] in y's dtype, for y_NL [N, L] the expert
    outputs in expert order and inverse_N [N] the inverse of the sort (a permutation of 0..N-1). Equals the
    combine of the rows put back in pair order (the gate weights kept in their own precision), with a backward
    for y_NL (in expert order, as y_NL came) and for the weights."""
    _check_pairs(y_NL, inverse_N, *weights_TK.shape)
    return _CombineFromExpertOrder.apply(y_NL.contiguous(), inverse_N.contiguous(), weights_TK.contiguous())


def sum_pairs_from_expert_order_triton(rows_NL: torch.Tensor, inverse_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """out[t] = sum_k rows_NL[inverse_N[t * top_k + k]] -> [N / top_k, L] in rows' dtype (fp32 sums): each token's
    top_k rows of an expert-order tensor added up, no autograd (k3.ops.moe.gather_pairs' backward)."""
    num_tokens = rows_NL.shape[0] // top_k
    _check_pairs(rows_NL, inverse_N, num_tokens, top_k)
    return _launch_expert_order_fwd(rows_NL.contiguous(), inverse_N.contiguous(), None, num_tokens, top_k)
