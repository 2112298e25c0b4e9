"""Quantile Balancing's two selections (k3.layers.balancing) as Triton kernels (k3.ops.qb_triton_kernels).

    topk_with_load:         (values, indices) = topk(scores + bias, k);  load_E = pairs per expert in the first
                            `counted` picks of every token
    kth_smallest_and_next:  qth_E = the q-th smallest of each column of required_TE;  upper_E = the smallest
                            value above it (qth_E + 1.0 when there is none)

Why: in `small`'s training step on one H200 (16,384 tokens, 64 experts, top-6, 15 MoE layers, 4 QB updates per
layer) the solver spent about 11 ms of a 177 ms step in torch.topk (gatherTopK + a bitonic sort, 69 us a call),
kthvalue over the transposed [E, T] (62 us, after a 9 us transposing copy) and the scatter-add that counts the
load (27 us a call). These kernels do a top-7 of 64 values per token by argmax rounds with the count folded in,
and a radix select per expert that reads the [T, E] matrix through its strides, each column cut into slices
over many programs.

Ties: the kernel picks the lowest expert id first among equal biased scores (as k3.ops.route_triton does);
torch.topk leaves their order unspecified (on CPU it does not take the lowest id). Values agree either way; ids,
and the load when a tie straddles the `counted` boundary, may not. NaN is not supported by either kernel: a row
with a NaN score gets unspecified in-range ids, a column with a NaN an unspecified quantile. A -0.0 is selected
as +0.0 (they compare equal).

No autograd: both run on detached scores under no_grad (the forced Triton backend raises on inputs that need a
gradient). Neither syncs with the host nor allocates by data, so both can be captured in a CUDA graph. The
PyTorch twins are *_torch below, held equal by tests/ops/test_qb_triton.py (through Triton's CPU interpreter
without a GPU). Under torch.compile the launchers are the custom ops `k3::qb_topk_with_load` and
`k3::qb_kth_smallest_and_next`. `K3_QB_BACKEND=auto|torch|triton`: auto takes the kernels for CUDA tensors.

Shape suffixes: T tokens, E experts, K picks per token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from k3.ops.route_triton import check_selection
from k3.ops.triton_support import interpreting, kernel_backend, kernel_module, multiprocessors, triton_importable

_ENV = "K3_QB_BACKEND"
# Not swept: a top-k tile of about 2K scores (32 tokens of 64 experts); 1,024 values per radix pass. In `small`'s
# graphed training step on one H200 the top-k took 8.6 us a call, and the radix select with one program per
# expert (64 programs, each reading 16K values four times) 74.6 us: columns are now cut into slices, about
# KTH_PROGRAMS_PER_SM programs per multiprocessor.
TOPK_TILE = 2048
KTH_BLOCK_T = 1024
KTH_NUM_WARPS = 8
KTH_PROGRAMS_PER_SM = 4
KTH_MAX_SLICES = 64


class TopkLoad(NamedTuple):
    """values [T, K] fp32 (descending), indices [T, K] int64, load_E [E] fp32. Takes the place of torch.topk's
    (values, indices) wherever only those two are read."""
    values: torch.Tensor
    indices: torch.Tensor
    load_E: torch.Tensor


def kernels(interpret: bool):
    return kernel_module("k3.ops.qb_triton_kernels", interpret)


def qb_backend() -> str:
    return kernel_backend(_ENV)


def qb_triton_pays(*tensors: torch.Tensor) -> bool:
    """Whether the kernels run: forced by K3_QB_BACKEND=triton, or with auto for CUDA tensors that need no
    gradient when triton imports."""
    backend = qb_backend()
    if backend != "auto":
        return backend == "triton"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return tensors[0].is_cuda and triton_importable()


def _no_grad(*tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("the QB kernels have no backward: call them under torch.no_grad() or on detached "
                           "tensors (or set K3_QB_BACKEND=torch)")


def expert_load(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert [E] (float) from the chosen ids. A scatter-add rather than torch.bincount, which reads the
    ids' min and max back to the host on CUDA (a sync per call)."""
    ids = topk_ids_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.float32, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids, dtype=torch.float32))


def topk_with_load_torch(scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int, counted: int) -> TopkLoad:
    """The PyTorch twin of topk_with_load_triton."""
    top = (scores_TE.float() + bias_E.float()).topk(k, dim=-1)
    return TopkLoad(top.values, top.indices, expert_load(top.indices[:, :counted], scores_TE.shape[1]))


def topk_with_load_triton(scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int,
                          counted: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores [T, E] (any float dtype, any strides), bias [E] -> (values [T, k] fp32, indices [T, k] int64,
    load [E] fp32): the top-k of scores + bias in fp32, and the pairs per expert among each token's first
    `counted` picks (0 <= counted <= k)."""
    import triton

    num_tokens, num_experts = scores_TE.shape
    check_selection(bias_E, num_experts, k, "scores")
    if not 0 <= counted <= k:
        raise ValueError(f"counted={counted} must lie in 0..k={k}")
    _no_grad(scores_TE, bias_E)
    device = scores_TE.device
    values = torch.empty(num_tokens, k, dtype=torch.float32, device=device)
    indices = torch.empty(num_tokens, k, dtype=torch.int64, device=device)
    load_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    if num_tokens == 0:
        return values, indices, load_E
    experts_pow2 = triton.next_power_of_2(num_experts)
    block_t = max(1, TOPK_TILE // experts_pow2)
    kernels(interpreting()).topk_with_load[(triton.cdiv(num_tokens, block_t),)](
        scores_TE, bias_E, values, indices, load_E, num_tokens, scores_TE.stride(0), scores_TE.stride(1),
        bias_E.stride(0), NUM_EXPERTS=num_experts, EXPERTS_POW2=experts_pow2, TOP_K=k,
        K_POW2=triton.next_power_of_2(k), COUNTED=counted, BLOCK_T=block_t)
    return values, indices, load_E


def kth_smallest_and_next_torch(required_TE: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch twin of kth_smallest_and_next_triton."""
    # kthvalue on the contiguous [E, T] is ~7x faster than a sort over dim 0 (on CPU).
    required_ET = required_TE.t().contiguous()
    qth_E = required_ET.kthvalue(q, dim=1).values
    # The next larger value is the smallest one above the q-th (ties with it count as the q-th): a masked min
    # instead of a second selection.
    above_ET = torch.where(required_ET > qth_E[:, None], required_ET, torch.full_like(required_ET, float("inf")))
    upper_E = above_ET.amin(dim=1)
    return qth_E, torch.where(torch.isinf(upper_E), qth_E + 1.0, upper_E)


def kth_block(num_tokens: int) -> int:
    """Values per radix pass: KTH_BLOCK_T, or fewer for a short column but never fewer than the program's threads:
    a smaller block would be replicated across threads, a layout tl.histogram has miscounted in some Triton
    versions (fixed in triton-lang/triton#7938)."""
    return min(KTH_BLOCK_T, max(32 * KTH_NUM_WARPS, 1 << max(0, num_tokens - 1).bit_length()))


def kth_slices(num_tokens: int, num_experts: int, device: torch.device) -> int:
    """Slices each column is split into: about KTH_PROGRAMS_PER_SM programs per multiprocessor in all, each at
    least one block of rows (one slice per column on CPU, where programs run one after another)."""
    if device.type != "cuda":
        return 1
    wanted = -(-KTH_PROGRAMS_PER_SM * multiprocessors(device.index) // max(1, num_experts))
    return max(1, min(wanted, -(-num_tokens // KTH_BLOCK_T), KTH_MAX_SLICES))


def kth_smallest_and_next_triton(required_TE: torch.Tensor, q: int,
                                 slices: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """required [T, E] fp32 (any strides), 1 <= q <= T -> (qth [E], upper [E]) fp32: each column's q-th smallest
    value and the smallest value above it, or qth + 1.0 when there is none (or only +inf).

    Four radix passes over columns cut into `slices` (kth_slices when None) row ranges, one program per (column,
    slice), then one program per column for the result: each pass's programs replay the digits chosen so far
    from the earlier passes' per-slice histograms, so the passes need no atomics and no zeroed buffer."""
    import triton

    num_tokens, num_experts = required_TE.shape
    if required_TE.dtype != torch.float32:
        raise ValueError(f"required_TE is {required_TE.dtype}; the kernel selects over fp32")
    if not 1 <= q <= num_tokens:
        raise ValueError(f"q={q} must lie in 1..{num_tokens} (the number of rows)")
    if slices is not None and not 1 <= slices <= KTH_MAX_SLICES:
        raise ValueError(f"slices={slices} must lie in 1..{KTH_MAX_SLICES}")
    _no_grad(required_TE)
    device = required_TE.device
    qth_E = torch.empty(num_experts, dtype=torch.float32, device=device)
    upper_E = torch.empty(num_experts, dtype=torch.float32, device=device)
    if num_experts == 0:
        return qth_E, upper_E
    slices = slices or kth_slices(num_tokens, num_experts, device)
    block_t = kth_block(triton.cdiv(num_tokens, slices))
    chunk = triton.cdiv(triton.cdiv(num_tokens, slices), block_t) * block_t  # whole blocks per slice
    slices = triton.cdiv(num_tokens, chunk)  # none empty after the rounding; the last one may be short
    # The kernels' scratch: keys [E, T], per-slice histograms of the 4 passes, pass 3's least key above.
    keys_ET = torch.empty(num_experts, num_tokens, dtype=torch.int32, device=device)
    hist = torch.empty(4, num_experts, slices, 256, dtype=torch.int32, device=device)
    least_ES = torch.empty(num_experts, slices, dtype=torch.int32, device=device)
    slices_pow2 = triton.next_power_of_2(slices)
    module = kernels(interpreting())
    for radix_pass in range(4):
        module.kth_radix_pass[(num_experts, slices)](
            required_TE, keys_ET, hist, least_ES, num_tokens, num_experts, slices, chunk, required_TE.stride(0),
            required_TE.stride(1), q, PASS=radix_pass, SLICES_POW2=slices_pow2, BLOCK_T=block_t,
            num_warps=KTH_NUM_WARPS)
    module.kth_finish[(num_experts,)](hist, least_ES, qth_E, upper_E, num_experts, slices, q,
                                      SLICES_POW2=slices_pow2, num_warps=4)
    return qth_E, upper_E


@torch.library.custom_op("k3::qb_topk_with_load", mutates_args=())
def topk_with_load_op(scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int,
                      counted: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return topk_with_load_triton(scores_TE, bias_E, k, counted)


@topk_with_load_op.register_fake
def _(scores_TE, bias_E, k, counted):
    num_tokens, num_experts = scores_TE.shape
    return (scores_TE.new_empty(num_tokens, k, dtype=torch.float32),
            scores_TE.new_empty(num_tokens, k, dtype=torch.int64),
            scores_TE.new_empty(num_experts, dtype=torch.float32))


@torch.library.custom_op("k3::qb_kth_smallest_and_next", mutates_args=())
def kth_smallest_and_next_op(required_TE: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kth_smallest_and_next_triton(required_TE, q)


@kth_smallest_and_next_op.register_fake
def _(required_TE, q):
    num_experts = required_TE.shape[1]
    return required_TE.new_empty(num_experts), required_TE.new_empty(num_experts)


def topk_with_load(scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int, counted: int) -> TopkLoad:
    """(scores + bias).topk(k) in fp32 and the load of the first `counted` picks, by K3_QB_BACKEND."""
    if not qb_triton_pays(scores_TE, bias_E):
        return topk_with_load_torch(scores_TE, bias_E, k, counted)
    if torch.compiler.is_compiling():  # dynamo cannot trace the launcher; the op is one opaque call
        return TopkLoad(*topk_with_load_op(scores_TE, bias_E, k, counted))
    return TopkLoad(*topk_with_load_triton(scores_TE, bias_E, k, counted))


def kth_smallest_and_next(required_TE: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q-th smallest, next larger or q-th + 1.0) of each column of required [T, E] fp32, by K3_QB_BACKEND."""
    if not qb_triton_pays(required_TE):
        return kth_smallest_and_next_torch(required_TE, q)
    if torch.compiler.is_compiling():
        return kth_smallest_and_next_op(required_TE, q)
    return kth_smallest_and_next_triton(required_TE, q)
