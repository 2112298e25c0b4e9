"""Routed-expert compute: tokens sorted by expert, one GLU per expert.

Three interchangeable paths, held equal by tests/ops/test_moe_ops.py:
- `experts_loop`: a Python loop over experts (CPU, and the oracle);
- `experts_grouped_mm`: one grouped GEMM per projection (torch._grouped_mm on CUDA), gate and up as one over
  many rows;
- `experts_gathered`: each routed pair's expert weights gathered and applied as a batched matmul, for
  torch.compile where the grouped GEMM cannot run (its meta function takes bf16 only): the loop reads its
  counts back to the host, which breaks the graph. It copies N expert weights, so it suits decode-sized N.
- `experts_triton` (k3.ops.moe_triton): two Triton kernels that read only the touched experts' weights, for
  decode-sized N in inference.
`experts_in_pair_order`: with the Triton kernels it skips the sort altogether (they take the pairs in pair order
and each expert's program finds its own), else it sorts, runs one of the paths above and puts the rows back in
pair order. LatentMoE calls `experts_in_either_order`, the same without that last step: after the sorted path it
gets the rows in expert order and the sort, and `combine_from_expert_order` reads them through the inverse
permutation in the combine itself (k3.ops.moe_combine's kernels), with no pair-order copy forward or backward.
`K3_MOE_BACKEND=torch|grouped|triton|auto` forces one (torch: the loop; `loop` is its old name); auto takes the Triton kernels for inference on CUDA up to
TRITON_MAX_ROWS rows, else the grouped GEMM for bf16 CUDA tensors whose widths meet its 16-byte alignment rule,
else the loop (eager) or the gathered path (under torch.compile).
`count_per_expert` counts routed pairs without a host sync (torch.bincount on CUDA reads the input's min and max
back to the host), so the grouped path can be captured in a CUDA graph.
`gather_pairs` and `unpermute_rows` move rows between token order and expert order. Both are permutations (each
pair row is read exactly once), so their backwards are gathers by the inverse permutation too, deterministic and
free of the scatter-adds (index_put_ with accumulate, index_add_) that autograd would run for plain indexing.
gather_pairs' backward (each token's K rows of the gradient summed) runs as one Triton kernel where the combine's
kernels run (K3_MOE_COMBINE, k3.ops.moe_combine): it was a row gather into pair order and a sum over K.

Shape suffixes: N routed pairs (tokens*top_k), E experts, F expert width, D expert input width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from k3 import kernels
from k3.ops.fused_backend import with_torch_fallback
from k3.ops.glu import glu_activation
from k3.ops.moe_combine import (auto_takes_triton, combine_backend, combine_from_expert_order_triton,
                                sum_pairs_from_expert_order_triton, weighted_sum_over_k)
from k3.ops.moe_triton import experts_by_ids, experts_triton, triton_pays


def experts_loop(x_ND: torch.Tensor, counts_E: list[int], w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                 w2_EDF: torch.Tensor, act: str, betas: tuple[float, float]) -> torch.Tensor:
    # unbind (not w[e]) so that backward stacks the expert gradients once instead of writing a full-size
    # zero gradient per expert slice.
    w1s, w3s, w2s = w1_EFD.unbind(0), w3_EFD.unbind(0), w2_EDF.unbind(0)
    out = []
    for e, xe in enumerate(x_ND.split(counts_E)):
        if xe.shape[0] == 0:
            continue
        h = glu_activation(xe @ w1s[e].t(), xe @ w3s[e].t(), act, *betas)
        out.append(h @ w2s[e].t())
    return torch.cat(out) if out else x_ND.new_zeros(0, w2_EDF.shape[1])


def inverse_permutation(index_N: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `index_N`: x[index_N][inverse_permutation(index_N)] == x (no host sync)."""
    inverse_N = torch.empty_like(index_N)
    inverse_N[index_N] = torch.arange(index_N.numel(), device=index_N.device)
    return inverse_N


class _GatherPairs(torch.autograd.Function):
    @staticmethod
    def forward(h_TL: torch.Tensor, order_N: torch.Tensor, top_k: int, inverse_N: torch.Tensor) -> torch.Tensor:
        return h_TL.index_select(0, order_N // top_k)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        h_TL, _, top_k, inverse_N = inputs
        ctx.save_for_backward(inverse_N)
        ctx.top_k, ctx.num_tokens = top_k, h_TL.shape[0]

    @staticmethod
    def backward(ctx, grad_NL: torch.Tensor):
        (inverse_N,) = ctx.saved_tensors
        return sum_pairs_per_token(grad_NL, inverse_N, ctx.num_tokens, ctx.top_k), None, None, None


def sum_pairs_per_token_twin(grad_NL: torch.Tensor, inverse_N: torch.Tensor, num_tokens: int,
                             top_k: int) -> torch.Tensor:
    # Pair t*K + k of token t sits at row inverse_N[t*K + k]: gathering rows back into pair order puts a token's K
    # copies next to each other, and a sum over K (fp32 accumulation inside torch's reduction for bf16) replaces
    # the scatter-add over tokens.
    grad_TKL = grad_NL.index_select(0, inverse_N).view(num_tokens, top_k, grad_NL.shape[-1])
    return grad_TKL.sum(1)


def sum_pairs_per_token(grad_NL: torch.Tensor, inverse_N: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """gather_pairs' backward: dh[t] = sum_k grad_NL[inverse_N[t * top_k + k]] -> [T, L] in grad's dtype (fp32
    sums), for grad_NL [N, L] in expert order. One Triton kernel where K3_MOE_COMBINE takes the combine's kernels
    (auto: CUDA, eager), else the gather and sum of the twin. A double backward (grad mode on inside the backward)
    keeps the twin, which autograd can differentiate."""
    if torch.is_grad_enabled() and grad_NL.requires_grad:
        return sum_pairs_per_token_twin(grad_NL, inverse_N, num_tokens, top_k)
    if combine_backend() == "triton":
        return sum_pairs_from_expert_order_triton(grad_NL, inverse_N, top_k)
    if auto_takes_triton(grad_NL):
        variant = ("moe_sum_pairs_per_token_triton", top_k, grad_NL.dtype)
        return with_torch_fallback(variant, lambda: sum_pairs_from_expert_order_triton(grad_NL, inverse_N, top_k),
                                   lambda: sum_pairs_per_token_twin(grad_NL, inverse_N, num_tokens, top_k))
    return sum_pairs_per_token_twin(grad_NL, inverse_N, num_tokens, top_k)


class _UnpermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(y_NL: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor) -> torch.Tensor:
        return y_NL.index_select(0, inverse_N)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad_NL: torch.Tensor):
        (order_N,) = ctx.saved_tensors
        return grad_NL.index_select(0, order_N), None, None  # inverse_N[order_N[i]] == i


def gather_pairs(h_TL: torch.Tensor, order_N: torch.Tensor, top_k: int, inverse_N: torch.Tensor) -> torch.Tensor:
    """Token rows h_TL [T, L] copied into expert order: row i of the result [N, L] (N = T*top_k) is token
    order_N[i] // top_k, for order_N a permutation of the pairs (t*top_k + k) and inverse_N its inverse
    (inverse_permutation(order_N)). Equals h_TL[order_N // top_k]; the backward is a gather and a sum over k."""
    return _GatherPairs.apply(h_TL, order_N, top_k, inverse_N)


def unpermute_rows(y_NL: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor) -> torch.Tensor:
    """Rows computed in `order_N` order (y_NL[i] belongs to pair order_N[i]) back in pair order [N, L]:
    equals y_NL[inverse_N]; the backward is the gather grad[order_N]."""
    return _UnpermuteRows.apply(y_NL, order_N, inverse_N)


def combine_from_expert_order_twin(y_NL: torch.Tensor, inverse_N: torch.Tensor, weights_TK: torch.Tensor,
                                   order_N: torch.Tensor | None = None) -> torch.Tensor:
    """The rows put back in pair order, then the pair-order combine (K3_MOE_COMBINE's bmm or sum form)."""
    if order_N is None:
        order_N = inverse_permutation(inverse_N)
    num_tokens, top_k = weights_TK.shape
    y_TKL = unpermute_rows(y_NL, order_N, inverse_N).view(num_tokens, top_k, y_NL.shape[-1])
    return weighted_sum_over_k(y_TKL, weights_TK)


def combine_from_expert_order(y_NL: torch.Tensor, inverse_N: torch.Tensor, weights_TK: torch.Tensor,
                              order_N: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_k weights_TK[t, k] * y_NL[inverse_N[t * K + k]] -> [T, L] in y's dtype, for y_NL [N, L] the
    experts' rows in expert order (as run_experts returns them), inverse_N [N] the inverse of the sort
    (sort_pairs_by_expert) and weights_TK [T, K] the gate weights. Equals weighted_sum_over_k of
    unpermute_rows(y_NL, order_N, inverse_N) viewed [T, K, L]; where K3_MOE_COMBINE takes the Triton kernels
    (auto: CUDA, eager) the kernels read the rows through the inverse and write y's gradient straight into expert
    order. order_N, the sort itself, is what the twin's backward gathers by (computed from inverse_N if None)."""
    if combine_backend() == "triton":
        return combine_from_expert_order_triton(y_NL, inverse_N, weights_TK)
    if auto_takes_triton(y_NL):
        variant = ("moe_combine_expert_order_triton", weights_TK.shape[1], y_NL.dtype, weights_TK.dtype)
        return with_torch_fallback(variant, lambda: combine_from_expert_order_triton(y_NL, inverse_N, weights_TK),
                                   lambda: combine_from_expert_order_twin(y_NL, inverse_N, weights_TK, order_N))
    return combine_from_expert_order_twin(y_NL, inverse_N, weights_TK, order_N)


def count_per_expert(ids_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed pairs per expert [E] (int64) from expert ids [N], computed on the device with no host sync."""
    return torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device).scatter_add_(
        0, ids_N.reshape(-1), torch.ones_like(ids_N.reshape(-1), dtype=torch.int64))


# A compiled step sorts pairs by counting (sort_pairs_by_expert) from COUNTING_SORT_MIN_PAIRS pairs up to
# COUNTING_SORT_MAX_CELLS (pair, expert) cells. Measured compiled, 64 experts, one H200 (bench/moe_decode.py
# --routing): at 384 pairs (batch 64, top-6) argsort 18.9 us per layer, counting 11.9; at 6 pairs argsort 5.0,
# counting 7.7. The switch lies between the two measured sizes.
COUNTING_SORT_MIN_PAIRS = 64
COUNTING_SORT_MAX_CELLS = 1 << 20


def sort_pairs_by_expert(ids_N: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order_N, inverse_N, counts_E) for routed pairs with expert ids ids_N [N]: order_N lists the pairs by expert,
    ties in pair order (equal to ids_N.argsort(stable=True)), inverse_N = inverse_permutation(order_N), counts_E
    [E] int64 pairs per expert.

    Inside a compiled graph and at batched decode sizes (COUNTING_SORT_MIN_PAIRS <= N, N * E <=
    COUNTING_SORT_MAX_CELLS) it is a counting sort: a pair's place is the rows of the experts before its own plus
    the pairs of its expert before it, a cumulative sum over the one-hot [N, E] table. Inductor fuses that into a
    few scans; the argsort it replaces became a single-program sort kernel of 19 us per MoE layer at batch 64
    (`small`, one H200), the largest routing kernel of the step.
    Eager, and for a few pairs, argsort stays: the counting form is more kernels there."""
    num_pairs = ids_N.numel()
    counting = COUNTING_SORT_MIN_PAIRS <= num_pairs and num_pairs * num_experts <= COUNTING_SORT_MAX_CELLS
    if not (torch.compiler.is_compiling() and counting):
        order_N = ids_N.argsort(stable=True)
        return order_N, inverse_permutation(order_N), count_per_expert(ids_N, num_experts)
    onehot_NE = (ids_N[:, None] == torch.arange(num_experts, device=ids_N.device)).to(torch.int32)
    seen_NE = onehot_NE.cumsum(0, dtype=torch.int32)  # pairs of each expert up to and including pair n
    counts_E = seen_NE[-1]
    rank_N = (seen_NE * onehot_NE).sum(1) - 1  # place of pair n among its expert's pairs
    starts_E = counts_E.cumsum(0, dtype=torch.int32) - counts_E
    inverse_N = (starts_E[ids_N] + rank_N).long()
    order_N = torch.empty_like(inverse_N).scatter_(0, inverse_N, torch.arange(num_pairs, device=ids_N.device))
    return order_N, inverse_N, counts_E.long()


def experts_grouped_mm(x_ND: torch.Tensor, counts_E: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                       w2_EDF: torch.Tensor, act: str, betas: tuple[float, float],
                       w13_E2FD: torch.Tensor | None = None) -> torch.Tensor:
    """x_ND sorted by expert, counts_E [E] (int, on x's device) -> [N, D]; one grouped GEMM per projection.
    Group ends are int32 offsets (what torch._grouped_mm takes); the weights enter as transposed views, which
    the kernel reads as column-major operands without a copy. w13_E2FD: w1 and w3 in one buffer [E, 2F, D]
    (k3.layers.fused_weights, a frozen model's), then gate and up come from one grouped GEMM.

    Training keeps two: concatenating w1 and w3 at every step for one GEMM cost a copy of both forward and a
    copy of each gradient out of the joined one backward, more than the second GEMM and the add of the two
    input gradients it saves (one H200, `small` graphed step: 172.0 ms joined, 168.2 ms separate)."""
    offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    dtype = x_ND.dtype
    if w13_E2FD is not None:
        gate_NF, up_NF = torch._grouped_mm(x_ND, w13_E2FD.to(dtype).transpose(1, 2), offs=offsets_E).chunk(2, -1)
    else:
        gate_NF = torch._grouped_mm(x_ND, w1_EFD.to(dtype).transpose(1, 2), offs=offsets_E)
        up_NF = torch._grouped_mm(x_ND, w3_EFD.to(dtype).transpose(1, 2), offs=offsets_E)
    h_NF = glu_activation(gate_NF, up_NF, act, *betas).to(dtype)
    return torch._grouped_mm(h_NF, w2_EDF.to(dtype).transpose(1, 2), offs=offsets_E)


def experts_gathered(x_ND: torch.Tensor, counts_E: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                     w2_EDF: torch.Tensor, act: str, betas: tuple[float, float]) -> torch.Tensor:
    """Same arguments and result as experts_grouped_mm, with no host sync and no data-dependent shape: row i
    belongs to the expert whose range of the sorted rows holds i."""
    ends_E = torch.cumsum(counts_E, 0)
    expert_N = torch.searchsorted(ends_E, torch.arange(x_ND.shape[0], device=x_ND.device), right=True)
    x_N1D = x_ND.unsqueeze(1)
    dtype = x_ND.dtype
    gate_N1F = torch.bmm(x_N1D, w1_EFD[expert_N].to(dtype).transpose(1, 2))
    up_N1F = torch.bmm(x_N1D, w3_EFD[expert_N].to(dtype).transpose(1, 2))
    h_N1F = glu_activation(gate_N1F, up_N1F, act, *betas).to(dtype)
    return torch.bmm(h_N1F, w2_EDF[expert_N].to(dtype).transpose(1, 2)).squeeze(1)


def _grouped_available(x: torch.Tensor, w1_EFD: torch.Tensor) -> bool:
    """The CUDA grouped GEMM takes bf16 operands whose rows are a multiple of 16 bytes (8 bf16 values)."""
    width_f, width_d = w1_EFD.shape[1], w1_EFD.shape[2]
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16
            and width_f % 8 == 0 and width_d % 8 == 0)


def moe_backend() -> str:
    return kernels.choice("moe")


# The pair-order kernels scan every routed pair in every expert's program, a cost that grows with N. Measured on
# one H200 per MoE layer (`small`, bench/moe_decode.py), from the routed ids to rows in pair order: at 6 pairs 16.0
# us, at 384 pairs 66.9 us against 54.4 for the sorted kernels alone plus the compiled sort's 12-19 (and two
# row permutations); at 1,020 pairs 114.7 us against 77.7 plus the sort. Above this many pairs, the sorted path.
PAIR_ORDER_MAX_PAIRS = 512


class ExpertOrder(NamedTuple):
    """The routed pairs sorted by expert: order_N lists the pairs by expert, inverse_N is its inverse (pair p sits
    at row inverse_N[p]), both as sort_pairs_by_expert returns them."""
    order_N: torch.Tensor
    inverse_N: torch.Tensor


def experts_in_pair_order(h_TL: torch.Tensor, ids_N: torch.Tensor, top_k: int, w1_EFL: torch.Tensor,
                          w3_EFL: torch.Tensor, w2_ELF: torch.Tensor, act: str, betas: tuple[float, float],
                          w13_E2FL: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts of token rows h_TL [T, L] for the pairs p = t * top_k + k routed to ids_N [N] -> [N, L]
    in pair order (row p: expert ids_N[p] applied to token p // top_k).

    Up to PAIR_ORDER_MAX_PAIRS pairs, where the Triton kernels run (K3_MOE_BACKEND, run_experts' rule), they take
    the pairs as they are (k3.ops.moe_triton.experts_by_ids: each expert's program finds its own pairs).
    Otherwise the pairs are sorted by expert, gathered, run by run_experts and put back in pair order."""
    y_NL, expert_order = experts_in_either_order(h_TL, ids_N, top_k, w1_EFL, w3_EFL, w2_ELF, act, betas, w13_E2FL)
    return y_NL if expert_order is None else unpermute_rows(y_NL, *expert_order)


def experts_in_either_order(h_TL: torch.Tensor, ids_N: torch.Tensor, top_k: int, w1_EFL: torch.Tensor,
                            w3_EFL: torch.Tensor, w2_ELF: torch.Tensor, act: str, betas: tuple[float, float],
                            w13_E2FL: torch.Tensor | None = None) -> tuple[torch.Tensor, ExpertOrder | None]:
    """experts_in_pair_order's rows in the order the path that ran left them: (y_NL, None) with y_NL [N, L] in pair
    order after the pair-order kernels, (y_NL, the sort) with y_NL in expert order after the sorted path. The
    second goes to combine_from_expert_order, which needs no pair-order copy of the rows."""
    backend = moe_backend()
    num_pairs = ids_N.numel()
    if num_pairs <= PAIR_ORDER_MAX_PAIRS:
        if backend == "triton":
            return experts_by_ids(h_TL, ids_N, w1_EFL, w3_EFL, w2_ELF, act, betas), None
        if backend == "auto" and triton_pays(h_TL, w1_EFL, w3_EFL, w2_ELF, num_rows=num_pairs):
            variant = ("moe_experts_by_ids_triton", act, tuple(w1_EFL.shape[1:]), h_TL.dtype)
            return with_torch_fallback(
                variant, lambda: (experts_by_ids(h_TL, ids_N, w1_EFL, w3_EFL, w2_ELF, act, betas), None),
                lambda: _sorted_by_expert(h_TL, ids_N, top_k, w1_EFL, w3_EFL, w2_ELF, act, betas, w13_E2FL))
    return _sorted_by_expert(h_TL, ids_N, top_k, w1_EFL, w3_EFL, w2_ELF, act, betas, w13_E2FL)


def _sorted_by_expert(h_TL, ids_N, top_k, w1_EFL, w3_EFL, w2_ELF, act, betas, w13_E2FL):
    # One inverse serves both permutations' forwards and backwards (gathers, no scatter-adds).
    order_N, inverse_N, counts_E = sort_pairs_by_expert(ids_N, w1_EFL.shape[0])
    x_NL = gather_pairs(h_TL, order_N, top_k, inverse_N)
    y_NL = run_experts(x_NL, counts_E, w1_EFL, w3_EFL, w2_ELF, act, betas, w13_E2FL)
    return y_NL, ExpertOrder(order_N, inverse_N)


def run_experts(x_ND: torch.Tensor, counts_E: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                w2_EDF: torch.Tensor, act: str, betas: tuple[float, float],
                w13_E2FD: torch.Tensor | None = None) -> torch.Tensor:
    """x_ND sorted by expert, counts_E [E] int tokens per expert -> [N, D]. w13_E2FD (optional): w1 and w3
    fused in one buffer, which the grouped GEMM path uses (the others read the w1 / w3 views of it)."""
    backend = moe_backend()
    if backend == "triton":
        return experts_triton(x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, betas)
    if backend == "auto" and triton_pays(x_ND, w1_EFD, w3_EFD, w2_EDF):
        # Chosen, not forced: a kernel variant Triton cannot compile here runs the other paths from then on.
        variant = ("moe_experts_triton", act, tuple(w1_EFD.shape[1:]), x_ND.dtype)
        return with_torch_fallback(variant, lambda: experts_triton(x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, betas),
                                   lambda: _without_triton(backend, x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act,
                                                           betas, w13_E2FD))
    return _without_triton(backend, x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, betas, w13_E2FD)


def _without_triton(backend, x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, betas, w13_E2FD):
    """The paths after the Triton kernels: the grouped GEMM, the gathered path under compile, the loop."""
    if backend == "grouped" or (backend == "auto" and _grouped_available(x_ND, w1_EFD)):
        return experts_grouped_mm(x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, betas, w13_E2FD)
    if backend == "auto" and torch.compiler.is_compiling():
        return experts_gathered(x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, betas)
    return experts_loop(x_ND, counts_E.tolist(), w1_EFD, w3_EFD, w2_EDF, act, betas)
