"""k3's own RMSNorm as two Triton kernels, forward and backward (k3.ops.rms_norm_triton_kernels).

    rstd = rsqrt(mean_D(x^2) + eps),   y = x * rstd * w                  (fp32 arithmetic, y in x's dtype)
    dx = rstd * (dy*w - x_hat * mean_D(dy*w*x_hat)),   dw = sum_rows dy * x_hat,   x_hat = x * rstd

and the gated norm of KDA's output, y = x * rstd * w * sigmoid(g), through the same kernels (GATED): the gate's
gradient is dy * x_hat * w * s * (1 - s) and dy * s stands for dy above. Why the gated one: fla's gated norm
autotunes per bucket of 65,536 rows, so k3.ops.norm kept it to training and short inputs and sent long
no-grad calls (prefill) to the eager twin, five elementwise kernels and fp32 copies: on one H100 that made k3's
KDA layer forward at B=4, T=8K 11.3 ms against 8.3 with autograd on (fla's layer: 8.3).

Why: in `small`'s training step on one H200 (16,384 tokens, D 1024, bf16) fla's RMSNorm backward took 9.3 ms of
GPU time over 56 calls, about 170 us a call where its bytes (x and dy read, dx written: 96 MB) take about 25 us
at 4 TB/s, and its Python side cost about 430 us of host time a call under the profiler, in a step that is partly
host-bound. These kernels read x once forward (and dy and x once backward) with a thin launcher. On one H200
(bench/rms_norm.py) their forward + backward took 1.4-1.9x the bytes' time at D = 512-2304, fla's 2-14x;
k3.ops.norm takes them for CUDA tensors by default (K3_RMS_NORM, see there).

The forward keeps rstd [N] fp32 for the backward (nothing under no_grad). dw is summed per program into a
[programs, D] fp32 buffer that torch sums: deterministic, no atomics. The PyTorch twin is k3.ops.norm.rms_norm_torch,
held equal by tests/ops/test_rms_norm_triton.py (through Triton's CPU interpreter, TRITON_INTERPRET=1).
Shape suffixes: N rows (every dim but the last), D hidden.
"""

from __future__ import annotations

import math

import torch

from k3.ops import vector_grads
from k3.ops.triton_support import Blocks, interpreting, kernel_module, multiprocessors, pow2_width

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows up to this width (as the next power of two) are loaded once, whole; wider ones go in chunks of WIDE_CHUNK.
WHOLE_ROW_MAX = 8192
WIDE_CHUNK = 4096


def kernels(interpret: bool):
    return kernel_module("k3.ops.rms_norm_triton_kernels", interpret)


# Unmeasured defaults, for bench/rms_norm.py --sweep to replace: a tile of about 4K elements (8 rows of 512, 4 of
# 1024, one of up to 8192) so each thread holds 32-64 values of a tensor; 4 warps, 8 for a tile of 8K.
def default_blocks(dim: int) -> Blocks:
    """The forward's and the backward's: the whole row in one chunk up to D = 8192, 1-8 rows by width."""
    block_d = pow2_width(dim) if pow2_width(dim) <= WHOLE_ROW_MAX else WIDE_CHUNK
    block_n = max(1, min(8, 4096 // block_d))
    return Blocks(block_n=block_n, block_d=block_d, num_warps=8 if block_n * block_d > 4096 else 4)


def programs_per_sm(blocks: Blocks) -> int:
    """Backward programs per multiprocessor, each looping over consecutive row blocks: about 32 warps resident
    per SM to keep loads in flight, and a dw buffer of a few MB at most."""
    return max(2, 32 // blocks.num_warps)


def _check(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None = None) -> None:
    if x.dim() == 0:
        raise ValueError("rms_norm_triton needs x [..., D] with at least one dimension, got a scalar")
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"x is {x.dtype} and weight {weight.dtype}; the kernels take {DTYPES} for each "
                         "(k3.ops.norm.rms_norm_torch takes any)")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight is {tuple(weight.shape)}; it must be [{x.shape[-1]}], x's last dim "
                         f"(x is {tuple(x.shape)})")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} and weight on {weight.device}; they must share a device")
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"gate is {tuple(gate.shape)}; it must have x's shape {tuple(x.shape)}")
        if gate.dtype not in DTYPES:
            raise ValueError(f"gate is {gate.dtype}; the kernels take {DTYPES}")
        if gate.device != x.device:
            raise ValueError(f"x is on {x.device} and gate on {gate.device}; they must share a device")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [N, D] with rows D apart: a view for a contiguous x, a copy otherwise."""
    x_ND = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return x_ND if x_ND.stride() == (x_ND.shape[1], 1) or x_ND.numel() == 0 else x_ND.contiguous()


def norm_forward(x_ND: torch.Tensor, weight_D: torch.Tensor, eps: float, save: bool,
                 blocks: Blocks | None = None, gate_ND: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, D] (rows D apart), weight [D], optional gate [N, D] (rows D apart) -> (y [N, D] in x's dtype,
    rstd [N] fp32 with save, else None)."""
    import triton

    num_rows, dim = x_ND.shape
    blocks = blocks or default_blocks(dim)
    y_ND = torch.empty_like(x_ND)
    rstd_N = torch.empty(num_rows, dtype=torch.float32, device=x_ND.device) if save else None
    if num_rows and dim:
        kernels(interpreting()).rms_norm_forward[(triton.cdiv(num_rows, blocks.block_n),)](
            x_ND, weight_D, gate_ND if gate_ND is not None else x_ND, y_ND, rstd_N if save else y_ND, num_rows,
            float(eps), D=dim, SAVE=save, GATED=gate_ND is not None, BLOCK_N=blocks.block_n,
            BLOCK_D=blocks.block_d, num_warps=blocks.num_warps)
    elif save:
        rstd_N.fill_(0.0)  # D = 0: nothing to normalise; keeps the buffer defined
    return y_ND, rstd_N


def norm_backward(dy_ND: torch.Tensor, x_ND: torch.Tensor, weight_D: torch.Tensor, rstd_N: torch.Tensor,
                  blocks: Blocks | None = None, gate_ND: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dy [N, D] and x [N, D] (rows D apart), weight [D], the forward's rstd [N], its gate [N, D] if any ->
    (dx [N, D] in x's dtype, dw [D] fp32, dgate [N, D] in the gate's dtype or None)."""
    dx_ND, dw_PD, dg_ND = norm_backward_partials(dy_ND, x_ND, weight_D, rstd_N, blocks, gate_ND)
    return dx_ND, dw_PD.sum(0), dg_ND


def norm_backward_partials(dy_ND: torch.Tensor, x_ND: torch.Tensor, weight_D: torch.Tensor, rstd_N: torch.Tensor,
                           blocks: Blocks | None = None, gate_ND: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """norm_backward with dw left as the programs' partial rows [P, D] fp32 (their sum is dw), for
    k3.ops.vector_grads to finish."""
    import triton

    num_rows, dim = x_ND.shape
    blocks = blocks or default_blocks(dim)
    dx_ND = torch.empty_like(x_ND)
    dg_ND = torch.empty_like(gate_ND) if gate_ND is not None else None
    num_blocks = triton.cdiv(num_rows, blocks.block_n)
    programs = blocks.programs
    if programs is None:
        programs = programs_per_sm(blocks) * multiprocessors(x_ND.device.index) if x_ND.is_cuda else 8
    per_program = triton.cdiv(num_blocks, max(1, min(programs, num_blocks)))
    programs = triton.cdiv(num_blocks, per_program) if num_blocks and dim else 0
    dw_PD = torch.empty(programs, dim, dtype=torch.float32, device=x_ND.device)  # every row written by the kernel
    if programs:
        gated = gate_ND is not None
        kernels(interpreting()).rms_norm_backward[(programs,)](
            x_ND, weight_D, gate_ND if gated else x_ND, dy_ND, rstd_N, dx_ND, dg_ND if gated else dx_ND, dw_PD,
            num_rows, per_program, D=dim, GATED=gated, BLOCK_N=blocks.block_n, BLOCK_D=blocks.block_d,
            num_warps=blocks.num_warps)
    elif dg_ND is not None:
        dg_ND.zero_()  # D = 0 or no rows: nothing flows to the gate
    return dx_ND, dw_PD, dg_ND


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, weight_D, gate_ND, eps, blocks, backward_blocks):
        y_ND, rstd_N = norm_forward(x_ND, weight_D, eps, True, blocks, gate_ND)
        ctx.save_for_backward(x_ND, weight_D, rstd_N, gate_ND)
        ctx.backward_blocks = backward_blocks
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, weight_D, rstd_N, gate_ND = ctx.saved_tensors
        if vector_grads.triton_chosen(dy_ND):  # dw's partial rows, summed and cast in one kernel
            dx_ND, dw_PD, dg_ND = norm_backward_partials(dy_ND.contiguous(), x_ND, weight_D, rstd_N,
                                                         ctx.backward_blocks, gate_ND)
            dw_D = vector_grads.summed_rows(dw_PD, weight_D.dtype) if ctx.needs_input_grad[1] else None
        else:
            dx_ND, dw_D, dg_ND = norm_backward(dy_ND.contiguous(), x_ND, weight_D, rstd_N, ctx.backward_blocks,
                                               gate_ND)
            dw_D = dw_D.to(weight_D.dtype) if ctx.needs_input_grad[1] else None
        dx_ND = dx_ND if ctx.needs_input_grad[0] else None
        dg_ND = dg_ND if ctx.needs_input_grad[2] else None
        return dx_ND, dw_D, dg_ND, None, None, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, blocks: Blocks | None = None,
                    backward_blocks: Blocks | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Same arguments and result as k3.ops.norm.rms_norm_torch: x [..., D] (fp32, bf16 or fp16), weight [D]
    (any of those) -> [..., D] in x's dtype, with gradients for x (x's dtype) and weight (weight's dtype).
    With `gate` (x's shape, any of those dtypes) the result is k3.ops.norm.rms_norm_gated_torch's, RMSNorm(x) *
    sigmoid(gate), and the gate gets its gradient in its own dtype.
    `blocks` (forward) and `backward_blocks` are the benchmark's to sweep (default_blocks when None)."""
    _check(x, weight, gate)
    x_ND = _rows(x)
    gate_ND = _rows(gate) if gate is not None else None
    weight = weight if weight.is_contiguous() else weight.contiguous()
    tracked = (x, weight) if gate is None else (x, weight, gate)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tracked):
        y_ND = _RMSNorm.apply(x_ND, weight, gate_ND, float(eps), blocks, backward_blocks)
    else:  # no rstd to keep
        y_ND = norm_forward(x_ND, weight, eps, False, blocks, gate_ND)[0]
    return y_ND.view(x.shape)
