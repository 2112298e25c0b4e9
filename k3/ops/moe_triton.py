"""Routed experts for decode-sized batches as two Triton kernels that read each touched expert's weights once.

    h = act(x W1[e]^T, x W3[e]^T)   (gate, up and the GLU activation in one kernel, fp32 accumulation)
    y = h W2[e]^T

x is sorted by expert (as for the grouped GEMM); expert e owns counts[e] rows after those of experts 0..e-1. The grid is
one program per (expert, block of output columns): a program whose expert received no row returns at once, so the
weights of untouched experts are never read, and a touched expert's weight tile is loaded once for all its rows
(decode has a few rows per expert). torch._grouped_mm, the prefill path, launches tiles sized for large GEMMs and
an extra setup kernel; at one token per step it spent 11.7 us per projection where the 6 experts' bytes take about
2 us at copy bandwidth (`small`, one H200).

The PyTorch twins are k3.ops.moe's experts_loop / experts_grouped_mm, held equal by tests/ops/test_moe_triton.py
(through Triton's CPU interpreter, TRITON_INTERPRET=1). Under torch.compile the launcher is the custom op
`k3::moe_experts_triton`, opaque to dynamo; its body is the same launch.

Shape suffixes: N routed rows (sorted by expert), E experts, F expert width, D expert input width.
"""

from __future__ import annotations

import torch

from k3.kernels import enabled as switch_enabled
from k3.ops.glu_triton import KINDS as GLU_KINDS
from k3.ops.triton_support import interpreting, kernel_module, multiprocessors, triton_importable

# Above this many routed rows the grouped GEMM's large tiles win (prefill); at or below it, these kernels.
TRITON_MAX_ROWS = 1024
# expert_matmul_by_ids scans the routed expert ids in chunks of this many pairs. One chunk for a batch-64 decode
# step (384 pairs): 63 us per `small` MoE layer where chunks of 256 took 69 (bench/moe_decode.py --pair-blocks and
# an A/B of the kernel source, one H200).
PAIR_BLOCK = 512


def kernels(interpret: bool):
    return kernel_module("k3.ops.moe_triton_kernels", interpret)


def block_sizes(num_rows: int, num_experts: int, out_width: int, in_width: int,
                num_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). Rows per expert are few in decode, so BLOCK_M is tl.dot's minimum; output
    columns are split finer (down to 32) while the touched experts (at most min(N, E)) would give the GPU fewer
    than two programs per multiprocessor, since each program streams its weight tile alone. Measured on one H200
    (bench/moe_decode.py, `small` and the matched config): of BLOCK_N 16-128 x BLOCK_K 64-256, 32 x 128 was
    fastest at one token and 64 x 128 within 2% of the best at 64 tokens; 16 was slower than 32 everywhere."""
    block_n = 64
    touched = max(1, min(num_rows, num_experts))
    while block_n > 32 and touched * -(-out_width // block_n) < 2 * num_sms:
        block_n //= 2
    block_k = min(128, max(16, 1 << (max(in_width, 1) - 1).bit_length()))
    return 16, block_n, block_k


def _launch(x: torch.Tensor, num_rows: int, counts_E: torch.Tensor | None, ids_N: torch.Tensor | None,
            pairs_per_row: int, w: torch.Tensor, w3: torch.Tensor | None, act: str, betas: tuple[float, float],
            blocks: tuple[int, ...] | None, pair_lists: tuple[torch.Tensor, torch.Tensor] | None = None,
            lists_mode: int = 0) -> torch.Tensor:
    """One projection over num_rows output rows: rows sorted by expert with counts_E (expert_matmul), or in
    pair order with ids_N (expert_matmul_by_ids, x row = pair // pairs_per_row). `pair_lists` ([E, N] and [E]
    int32) with lists_mode 1 (store) or 2 (load): see expert_matmul_by_ids's LISTS."""
    import triton

    num_experts, out_width, in_width = w.shape[0], w.shape[1], w.shape[2]
    out = x.new_empty(num_rows, out_width)
    if num_rows == 0:
        return out
    if blocks is None:
        num_sms = multiprocessors(x.device.index) if x.is_cuda else 132
        blocks = block_sizes(num_rows, num_experts, out_width, in_width, num_sms)
    block_m, block_n, block_k = blocks[:3]
    # An optional (num_warps, num_stages) after the block sizes (the benchmark sweeps them); Triton's defaults else.
    launch = dict(zip(("num_warps", "num_stages"), blocks[3:]))
    glu = w3 is not None
    w3 = w if w3 is None else w3
    grid = (num_experts, triton.cdiv(out_width, block_n))
    common = (x.stride(0), x.stride(1), *w.stride(), *w3.stride(), out.stride(0), out.stride(1), float(betas[0]),
              float(betas[1]), out_width, in_width)
    flags = dict(GLU=glu, SITU=act == "situ", UPCAST=interpreting(), BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=block_k)
    module = kernels(interpreting())
    if ids_N is None:
        module.expert_matmul[grid](x, w, w3, out, counts_E, *common, NUM_EXPERTS=num_experts,
                                   EXPERTS_POW2=triton.next_power_of_2(num_experts), **flags, **launch)
    else:
        block_p = min(PAIR_BLOCK, max(16, triton.next_power_of_2(num_rows)))
        lists, counts = (ids_N, ids_N) if pair_lists is None else pair_lists  # not read with lists_mode 0
        module.expert_matmul_by_ids[grid](x, w, w3, out, ids_N, num_rows, lists, counts, *common,
                                          PAIRS_PER_ROW=pairs_per_row, LISTS=lists_mode, BLOCK_P=block_p, **flags,
                                          **launch)
    return out


def experts_triton_eager(x_ND: torch.Tensor, counts_E: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                         w2_EDF: torch.Tensor, act: str, betas: tuple[float, float],
                         blocks: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> torch.Tensor:
    """x_ND sorted by expert, counts_E [E] rows per expert -> [N, D] in x's dtype: the two launches.
    `blocks`: (gate-up, down) block sizes, each optionally followed by (num_warps, num_stages); chosen by
    block_sizes when None (the benchmark sweeps them)."""
    if act not in GLU_KINDS:
        raise ValueError(f"unknown GLU activation {act!r}; use one of {GLU_KINDS}")
    dtype = x_ND.dtype
    rows = x_ND.shape[0]
    h_NF = _launch(x_ND, rows, counts_E, None, 1, w1_EFD.to(dtype), w3_EFD.to(dtype), act, betas, blocks and blocks[0])
    return _launch(h_NF, rows, counts_E, None, 1, w2_EDF.to(dtype), None, act, betas, blocks and blocks[1])


def experts_by_ids_eager(h_TD: torch.Tensor, ids_N: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                         w2_EDF: torch.Tensor, act: str, betas: tuple[float, float],
                         blocks: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                         shared_lists: bool | None = None) -> torch.Tensor:
    """Token rows h_TD [T, D] and the routed experts ids_N [N] of pairs p = t * top_k + k -> [N, D] in pair order,
    with no sort: row p is expert ids_N[p]'s GLU of token p // top_k. Equals the sorted path's result after its
    unpermute (tests/ops/test_moe_triton.py).

    shared_lists (None: K3_MOE_PAIR_LISTS, default 0): the first projection's programs store each expert's pairs
    and the second loads them instead of scanning the ids again. Same result. Off: on one H200 it saved 1 us a
    layer at 64 tokens (63.0 -> 62.0, bench/moe_decode.py) and cost 0.7 at one token."""
    if act not in GLU_KINDS:
        raise ValueError(f"unknown GLU activation {act!r}; use one of {GLU_KINDS}")
    num_pairs, num_tokens = ids_N.numel(), h_TD.shape[0]
    if num_tokens and num_pairs % num_tokens:
        raise ValueError(f"{num_pairs} routed pairs for {num_tokens} tokens: expected top_k pairs per token")
    top_k = num_pairs // num_tokens if num_tokens else 1
    dtype = h_TD.dtype
    ids_N = ids_N.reshape(-1)
    share = pair_lists_from_env() if shared_lists is None else shared_lists
    lists = None
    if share:
        num_experts = w1_EFD.shape[0]
        lists = (torch.empty(num_experts, num_pairs, dtype=torch.int32, device=ids_N.device),
                 torch.empty(num_experts, dtype=torch.int32, device=ids_N.device))
    h_NF = _launch(h_TD, num_pairs, None, ids_N, top_k, w1_EFD.to(dtype), w3_EFD.to(dtype), act, betas,
                   blocks and blocks[0], lists, 1 if share else 0)
    return _launch(h_NF, num_pairs, None, ids_N, 1, w2_EDF.to(dtype), None, act, betas, blocks and blocks[1],
                   lists, 2 if share else 0)


def pair_lists_from_env() -> bool:
    """K3_MOE_PAIR_LISTS: 1 shares the experts' pair lists between the two pair-order kernels, 0 (default) scans
    the ids in both."""
    return switch_enabled("moe_pair_lists")


@torch.library.custom_op("k3::moe_experts_triton", mutates_args=())
def moe_experts_triton_op(x_ND: torch.Tensor, counts_E: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                          w2_EDF: torch.Tensor, act: str, beta_gate: float, beta_up: float) -> torch.Tensor:
    return experts_triton_eager(x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, (beta_gate, beta_up))


@moe_experts_triton_op.register_fake
def _(x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, beta_gate, beta_up):
    return x_ND.new_empty(x_ND.shape[0], w2_EDF.shape[1])


@torch.library.custom_op("k3::moe_experts_by_ids_triton", mutates_args=())
def moe_experts_by_ids_op(h_TD: torch.Tensor, ids_N: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                          w2_EDF: torch.Tensor, act: str, beta_gate: float, beta_up: float) -> torch.Tensor:
    return experts_by_ids_eager(h_TD, ids_N, w1_EFD, w3_EFD, w2_EDF, act, (beta_gate, beta_up))


@moe_experts_by_ids_op.register_fake
def _(h_TD, ids_N, w1_EFD, w3_EFD, w2_EDF, act, beta_gate, beta_up):
    return h_TD.new_empty(ids_N.numel(), w2_EDF.shape[1])


def experts_by_ids(h_TD: torch.Tensor, ids_N: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                   w2_EDF: torch.Tensor, act: str, betas: tuple[float, float]) -> torch.Tensor:
    """experts_by_ids_eager, as one opaque op under torch.compile. Inference only (no backward)."""
    if torch.compiler.is_compiling():
        return moe_experts_by_ids_op(h_TD, ids_N, w1_EFD, w3_EFD, w2_EDF, act, *betas)
    return experts_by_ids_eager(h_TD, ids_N, w1_EFD, w3_EFD, w2_EDF, act, betas)


def experts_triton(x_ND: torch.Tensor, counts_E: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                   w2_EDF: torch.Tensor, act: str, betas: tuple[float, float]) -> torch.Tensor:
    """Same arguments and result as k3.ops.moe.experts_grouped_mm, inference only (no backward)."""
    if torch.compiler.is_compiling():  # dynamo cannot trace the launcher; the op is one opaque call in the graph
        return moe_experts_triton_op(x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, *betas)
    return experts_triton_eager(x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, betas)


def triton_pays(x_ND: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                num_rows: int | None = None) -> bool:
    """Auto-selection: CUDA, half-precision rows, decode-sized N (num_rows, x_ND's rows unless given), no autograd
    graph (no backward here)."""
    num_rows = x_ND.shape[0] if num_rows is None else num_rows
    if not (x_ND.is_cuda and x_ND.dtype in (torch.bfloat16, torch.float16) and num_rows <= TRITON_MAX_ROWS):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_ND, w1_EFD, w3_EFD, w2_EDF)):
        return False
    return triton_importable()
