"""The Attention-Residual mix as two Triton kernels, forward and backward (k3.ops.attn_res_triton_kernels).

    q = norm_weight * query,   r_i = rsqrt(mean_D(v_i^2) + eps),   alpha = softmax_i((v_i . q) r_i)
    mix = sum_i alpha_i v_i                          (fp32 arithmetic, written in the sources' dtype)

Why: the mix is memory-bound (S sources in, one out; S sources and dmix in, S gradients out), and its compiled
twin (torch.compile over a torch.stack) sat far above the memory floor: at `small`'s training shape on one H200
(16,384 tokens, D 1024, 2-5 sources) 0.81-1.82 ms per mix forward + backward, 12.6-13.3x the floor, about 42 ms
over a step's 32 mixes, because Inductor's kernels are poor under the unbacked token dimension, the mix came out
in fp32 and was cast, and the stack is one more copy of the sources. These kernels take 0.13-0.29 ms (2.0-2.1x).
Here each source is read in place (a tuple of pointers), a program's rows are read a second time from L2 (the
weights need every source's full row first), and the output and gradients are written once in their own dtype.
The backward keeps fp32 alpha, 1/rms and v.q per (token, source) from the forward ([N, S], tiny); dq is summed
per program into a [programs, D] buffer that torch sums (deterministic: no atomics).
Measured on one H200 (bench/attn_res.py, N = 16384, D = 1024, bf16 sources, GPU time): forward + backward 0.13,
0.19, 0.23, 0.29 ms at S = 2..5, about 2x the memory floor, against 0.81-1.82 ms compiled (~6x) and 1.5-3.4 ms
eager; at K3's D = 7168, S = 10, 6.3 ms against 21.8 compiled. (Those runs had the backward at 8 x 512 blocks;
its defaults below were the sweep's best in the same runs.)

The PyTorch twin is k3.ops.attn_res.attn_res_mix_eager, held equal by tests/ops/test_attn_res_triton.py (through
Triton's CPU interpreter, TRITON_INTERPRET=1, without a GPU). k3.ops.attn_res dispatches here.
Shape suffixes: S sources, N tokens (B*T), D hidden.
"""

from __future__ import annotations

import torch

from k3.kernels import enabled as switch_enabled
from k3.ops import vector_grads
from k3.ops.triton_support import Blocks, interpreting, kernel_module, multiprocessors, pow2_width

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The kernels unroll over the sources (one compiled variant per count, every load spelled out): auto takes them up
# to this many, which K3's block AttnRes stays under (about 10 at 93 layers in blocks of 12); the tests go to 16.
MAX_SOURCES = 16


def kernels(interpret: bool):
    return kernel_module("k3.ops.attn_res_triton_kernels", interpret)


# The defaults below come from bench/attn_res.py --sweep on one H200 (N = 16384 bf16 tokens; BLOCK_N 1-16 x
# BLOCK_D 256-1024 x 4 or 8 warps, GPU time from the profiler, one run, single readings about 10% apart).
def default_blocks(num_sources: int, dim: int) -> Blocks:
    """The forward's: 8 rows in chunks of 256 on 4 warps was the best or within ~10% of it at D = 1024 (S 2 and
    5: 0.039 and 0.075 ms, 1.6x the memory floor at S = 5) and at D = 7168, S = 10 (1.50 ms against 1.43 for 4
    rows, 2.4x the floor)."""
    return Blocks(block_n=8, block_d=min(256, pow2_width(dim)))


def default_backward_blocks(num_sources: int, dim: int) -> Blocks:
    """The backward's: up to D = 1024 the whole row in one chunk, 4 rows on 4 warps (0.070 and 0.166 ms at S 2
    and 5, against 0.08-0.09 and 0.19-0.22 for 8 x 512 and 0.13 and 0.23 for 8 x 256); wider rows in chunks of
    256, 8 rows (2.86 ms at D = 7168, S = 10, against 4.76 for 8 x 512 and 4.9 for 4 x 1024)."""
    if dim <= 1024:
        return Blocks(block_n=4, block_d=pow2_width(dim))
    return Blocks(block_n=8, block_d=256)


def programs_per_sm(dim: int) -> int:
    """Backward programs per multiprocessor: each loops over consecutive row blocks, so dq's partial buffer has a
    row per program rather than per block. The count made no difference at D = 1024 (2-64 per SM within noise); at
    D = 7168, S = 10, 16 per SM took 4.23 ms where 2-8 took 4.78 (with 8 x 512 blocks), and the [programs, D] fp32
    buffer that costs is small next to such a row's traffic."""
    return 8 if dim <= 2048 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [N, D] with rows D apart: a view for the model's contiguous sources, a copy otherwise."""
    x_ND = x.reshape(-1, x.shape[-1])
    return x_ND if x_ND.stride() == (x_ND.shape[1], 1) else x_ND.contiguous()


def _check(sources: list[torch.Tensor] | tuple[torch.Tensor, ...], norm_weight_D: torch.Tensor,
           query_D: torch.Tensor) -> None:
    if not sources:
        raise ValueError("attn_res_mix_triton needs at least one source")
    first = sources[0]
    for i, s in enumerate(sources):
        if s.shape != first.shape or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(f"source {i} is {tuple(s.shape)} {s.dtype} on {s.device}; every source must match "
                             f"source 0: {tuple(first.shape)} {first.dtype} on {first.device}")
    if first.dtype not in DTYPES:
        raise ValueError(f"sources are {first.dtype}; the kernels take {DTYPES} (attn_res_mix_eager takes any)")
    dim = first.shape[-1]
    if norm_weight_D.shape != (dim,) or query_D.shape != (dim,):
        raise ValueError(f"norm_weight {tuple(norm_weight_D.shape)} and query {tuple(query_D.shape)} must both "
                         f"be [{dim}], the sources' last dim")


def mix_forward(sources_ND: tuple[torch.Tensor, ...], q_D: torch.Tensor, eps: float, save: bool,
                blocks: Blocks | None = None):
    """Sources [N, D] (rows D apart), q_D fp32 -> (mix [N, D] in the sources' dtype, and with save alpha, 1/rms
    and v.q, each [N, S] fp32; None each without)."""
    import triton

    num_rows, dim = sources_ND[0].shape
    count = len(sources_ND)
    blocks = blocks or default_blocks(count, dim)
    out_ND = torch.empty_like(sources_ND[0])
    stats = [torch.empty(num_rows, count, dtype=torch.float32, device=out_ND.device) for _ in range(3)] if save \
        else [out_ND] * 3  # unused pointers when SAVE is off
    if num_rows:
        kernels(interpreting()).attn_res_forward[(triton.cdiv(num_rows, blocks.block_n),)](
            tuple(sources_ND), q_D, out_ND, *stats, num_rows, float(eps), D=dim, S=count,
            S_PAD=triton.next_power_of_2(count), SAVE=save, BLOCK_N=blocks.block_n, BLOCK_D=blocks.block_d,
            num_warps=blocks.num_warps)
    return (out_ND, *stats) if save else (out_ND, None, None, None)


def mix_backward(grad_ND: torch.Tensor, sources_ND: tuple[torch.Tensor, ...], q_D: torch.Tensor,
                 alpha_NS: torch.Tensor, inv_rms_NS: torch.Tensor, dot_NS: torch.Tensor,
                 blocks: Blocks | None = None, into: tuple[torch.Tensor | None, ...] | None = None,
                 accumulate: int = 0) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """dmix [N, D] (rows D apart) and the forward's saved statistics -> (one gradient [N, D] per source in its
    dtype, dq [D] fp32). `into[i]`, where given, is the [N, D] tensor source i's gradient is written to (else a
    new one); with bit i of `accumulate` set it is added to what that tensor holds."""
    grads, dq_PD = mix_backward_partials(grad_ND, sources_ND, q_D, alpha_NS, inv_rms_NS, dot_NS, blocks, into,
                                         accumulate)
    return grads, dq_PD.sum(0)


def mix_backward_partials(grad_ND: torch.Tensor, sources_ND: tuple[torch.Tensor, ...], q_D: torch.Tensor,
                          alpha_NS: torch.Tensor, inv_rms_NS: torch.Tensor, dot_NS: torch.Tensor,
                          blocks: Blocks | None = None, into: tuple[torch.Tensor | None, ...] | None = None,
                          accumulate: int = 0) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """mix_backward with dq left as the programs' partial rows [P, D] fp32 (their sum is dq), for
    k3.ops.vector_grads to finish."""
    import triton

    num_rows, dim = sources_ND[0].shape
    count = len(sources_ND)
    blocks = blocks or default_backward_blocks(count, dim)
    into = into or (None,) * count
    for i, target in enumerate(into):
        if (accumulate >> i) & 1 and target is None:
            raise ValueError(f"bit {i} of accumulate is set but into[{i}] is None: there is nothing to add to")
    grads = tuple(t if t is not None else torch.empty_like(s) for s, t in zip(sources_ND, into))
    num_blocks = triton.cdiv(num_rows, blocks.block_n)
    programs = blocks.programs
    if programs is None:
        programs = programs_per_sm(dim) * multiprocessors(grad_ND.device.index) if grad_ND.is_cuda else 8
    per_program = triton.cdiv(num_blocks, max(1, min(programs, num_blocks)))
    programs = triton.cdiv(num_blocks, per_program) if num_blocks else 0
    dq_PD = torch.empty(programs, dim, dtype=torch.float32, device=grad_ND.device)  # the kernel zeroes its rows
    if programs:
        kernels(interpreting()).attn_res_backward[(programs,)](
            tuple(sources_ND), grads, grad_ND, q_D, alpha_NS, inv_rms_NS, dot_NS, dq_PD, num_rows, per_program,
            D=dim, S=count, S_PAD=triton.next_power_of_2(count), ACC=accumulate, BLOCK_N=blocks.block_n,
            BLOCK_D=blocks.block_d, num_warps=blocks.num_warps)
    return grads, dq_PD


class SourceGradient:
    """Where the mixes that read one finished source sum its gradient, in the backward (see FinishedSources)."""

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source
        self.grad_ND: torch.Tensor | None = None


class _Collect(torch.autograd.Function):
    """source -> an empty token. Mixes take the token instead of the source, so the source has one consumer in
    autograd's graph; the engine runs this backward only after every mix holding the token has run its own, and
    it hands the source the gradient they summed."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, slot: SourceGradient) -> torch.Tensor:
        ctx.slot = slot
        return source.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        slot = ctx.slot
        grad_ND, slot.grad_ND = slot.grad_ND, None  # released: a second backward (retain_graph) starts afresh
        return (grad_ND.view(slot.source.shape) if grad_ND is not None else None), None


class FinishedSources:
    """The finished sources of an AttnRes stream (the embedding, the closed blocks), each read by every later mix.

    Left to autograd, a source read by n mixes gets n gradient tensors and n - 1 additions of them (about 80
    [tokens, D] additions in `small`'s step: 3.2 GB of traffic at 16K tokens). Registered here, the Triton
    backward of each mix adds its share into the source's one gradient tensor in place (the first writes it), and
    a _Collect node passes the sum on once. Other backends ignore the registration (they take the sources
    themselves), so a stream may register whatever its mixes end up running."""

    def __init__(self) -> None:
        self.slots: list[SourceGradient] = []
        self.tokens: list[torch.Tensor] = []

    def add(self, source: torch.Tensor) -> None:
        """Register the next finished source (a source without a gradient is recorded, never summed into)."""
        slot = SourceGradient(source)
        self.slots.append(slot)
        self.tokens.append(_Collect.apply(source, slot) if torch.is_grad_enabled() and source.requires_grad
                           else None)

    def leading(self, sources: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> int:
        """How many of `sources`, from the first, are this object's sources in order (the ones a mix may sum
        in place)."""
        count = 0
        for source, slot, token in zip(sources, self.slots, self.tokens):
            if source is not slot.source or token is None:
                break
            count += 1
        return count


def accumulate_finished() -> bool:
    """K3_ATTN_RES_ACCUMULATE=0 turns the in-place sums off (autograd adds the mixes' gradients, as before)."""
    return switch_enabled("attn_res_accumulate")


class _AttnResMix(torch.autograd.Function):
    """Inputs after the options: one token per slot (FinishedSources), then the sources; the first len(slots)
    sources come detached, their gradients summed into the slots instead of returned."""

    @staticmethod
    def forward(ctx, norm_weight_D, query_D, eps, blocks, backward_blocks, slots, *inputs):
        sources_ND = inputs[len(slots):]
        q_D = vector_grads.product(norm_weight_D, query_D)
        out_ND, alpha_NS, inv_rms_NS, dot_NS = mix_forward(sources_ND, q_D, eps, True, blocks)
        ctx.save_for_backward(norm_weight_D, query_D, q_D, alpha_NS, inv_rms_NS, dot_NS, *sources_ND)
        ctx.backward_blocks, ctx.slots = backward_blocks, slots
        return out_ND

    @staticmethod
    def backward(ctx, grad_ND):
        norm_weight_D, query_D, q_D, alpha_NS, inv_rms_NS, dot_NS, *sources_ND = ctx.saved_tensors
        slots = ctx.slots
        accumulate = 0
        for i, slot in enumerate(slots):
            if slot.grad_ND is None:
                slot.grad_ND = torch.empty_like(sources_ND[i])
            else:
                accumulate |= 1 << i
        into = tuple(slot.grad_ND for slot in slots) + (None,) * (len(sources_ND) - len(slots))
        if vector_grads.triton_chosen(grad_ND):  # dq's partial rows, summed with the products in one kernel
            grads, dq_PD = mix_backward_partials(grad_ND.contiguous(), tuple(sources_ND), q_D, alpha_NS,
                                                 inv_rms_NS, dot_NS, ctx.backward_blocks, into, accumulate)
            d_norm_weight, d_query = vector_grads.summed_rows_times(dq_PD, query_D, norm_weight_D,
                                                                    norm_weight_D.dtype, query_D.dtype)
            d_norm_weight = d_norm_weight if ctx.needs_input_grad[0] else None
            d_query = d_query if ctx.needs_input_grad[1] else None
        else:
            grads, dq_D = mix_backward(grad_ND.contiguous(), tuple(sources_ND), q_D, alpha_NS, inv_rms_NS, dot_NS,
                                       ctx.backward_blocks, into, accumulate)
            d_norm_weight = (dq_D * query_D.float()).to(norm_weight_D.dtype) if ctx.needs_input_grad[0] else None
            d_query = (dq_D * norm_weight_D.float()).to(query_D.dtype) if ctx.needs_input_grad[1] else None
        needed = ctx.needs_input_grad[6 + 2 * len(slots):]  # after the tokens and the detached sources
        grads = [None] * len(slots) + [g if n else None for g, n in zip(grads[len(slots):], needed)]
        return d_norm_weight, d_query, None, None, None, None, *([None] * len(slots)), *grads


def attn_res_mix_triton(sources: list[torch.Tensor], norm_weight_D: torch.Tensor, query_D: torch.Tensor,
                        eps: float, blocks: Blocks | None = None, backward_blocks: Blocks | None = None,
                        finished: FinishedSources | None = None) -> torch.Tensor:
    """Same arguments and result as k3.ops.attn_res.attn_res_mix_eager: S sources [B, T, D] (fp32, bf16 or fp16,
    all alike), norm_weight_D and query_D [D] -> the mix [B, T, D] in the sources' dtype, with gradients for
    every source, norm_weight and query. `blocks` (forward) and `backward_blocks` are the benchmark's to sweep
    (default_blocks and default_backward_blocks when None). Leading sources registered in `finished` get their
    gradients summed in place (FinishedSources)."""
    _check(sources, norm_weight_D, query_D)
    shape = sources[0].shape
    sources_ND = tuple(_rows(s) for s in sources)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*sources, norm_weight_D, query_D))
    if needs_grad:
        count = finished.leading(sources) if finished is not None and accumulate_finished() else 0
        # A source read through a copy (_rows) is not the registered tensor: it and those after it go to autograd.
        count = next((i for i in range(count) if sources_ND[i].data_ptr() != sources[i].data_ptr()), count)
        slots = tuple(finished.slots[:count]) if count else ()
        tokens = finished.tokens[:count] if count else []
        inputs = (*tokens, *(s.detach() for s in sources_ND[:count]), *sources_ND[count:])
        out_ND = _AttnResMix.apply(norm_weight_D, query_D, float(eps), blocks, backward_blocks, slots, *inputs)
    else:  # no statistics to keep
        q_D = vector_grads.product(norm_weight_D, query_D)
        out_ND = mix_forward(sources_ND, q_D, eps, False, blocks)[0]
    return out_ND.view(shape)
