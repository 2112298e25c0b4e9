"""The Triton kernel behind k3.ops.adamw_triton (see there); a module of its own because it imports triton.

One program per BLOCK elements of four flat contiguous tensors (param, grad, exp_avg, exp_avg_sq), each read in
its own dtype, updated in fp32 and written back rounded once. The step count is read from a one-element tensor
on the device (the count of the step being taken, already incremented, as torch's fused AdamW reads it), so a
launch needs nothing from the host that changes between steps but lr.
"""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting
from k3.ops.triton_support import kernel_module

# Whether this import decorated the kernel for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = triton_interpreting()
_cast = kernel_module("k3.ops.triton_cast", INTERPRETED).cast_rounded

# Bits of the step count that the bias corrections' powers cover: any count an fp32 step tensor holds exactly.
# A constexpr: the compiler refuses any other global inside a kernel (the interpreter does not, so only a GPU, or
# a compile for one, shows it).
_STEP_BITS = tl.constexpr(31)


@triton.jit
def _bias_corrections(step_ptr, beta1, beta2):
    """(1 - beta1^t, 1 - beta2^t) in fp64 for the whole step count t at step_ptr. In fp32, 1 - 0.999^1 would keep
    five digits (0.999 itself rounds by 1e-8, a relative 1e-5 of 0.001); torch computes these in double. The
    powers come from repeated squaring, which needs only multiplies (no libdevice pow, the same in the
    interpreter): each program spends some hundred fp64 operations on them, nothing beside its BLOCK loads."""
    remaining = tl.load(step_ptr).to(tl.int32)
    square1, square2 = beta1, beta2
    power1 = tl.full((), 1.0, tl.float64)
    power2 = tl.full((), 1.0, tl.float64)
    for _ in tl.static_range(_STEP_BITS):
        bit_set = (remaining & 1) != 0
        power1 = tl.where(bit_set, power1 * square1, power1)
        power2 = tl.where(bit_set, power2 * square2, power2)
        square1 = square1 * square1
        square2 = square2 * square2
        remaining = remaining >> 1
    return 1.0 - power1, 1.0 - power2


@triton.jit
def adamw_step(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, numel, lr: tl.float64,
               beta1: tl.float64, beta2: tl.float64, eps: tl.float64, weight_decay: tl.float64,
               DECAY: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One AdamW step in the order of torch's fused kernel (ATen's fused_adam_utils.cuh, ADAMW mode):

        param -= lr * weight_decay * param                      (DECAY: weight_decay != 0, skipped like torch)
        exp_avg = beta1 * exp_avg + (1 - beta1) * grad          (grad negated under MAXIMIZE)
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
        param -= (lr / (1 - beta1^t)) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)

    The scalars arrive as fp64 (so do torch's); what multiplies a tensor element is rounded to fp32 once."""
    # The interpreter passes a scalar argument as a Python float, which Triton types as fp32; full() makes it
    # the fp64 the compiled kernel receives.
    lr, beta1, beta2 = tl.full((), lr, tl.float64), tl.full((), beta1, tl.float64), tl.full((), beta2, tl.float64)
    eps, weight_decay = tl.full((), eps, tl.float64), tl.full((), weight_decay, tl.float64)
    correction1, correction2 = _bias_corrections(step_ptr, beta1, beta2)
    # As torch rounds them: its fp64 corrections reach the element math as fp32 (the second after its fp64 square
    # root), and lr / correction1 is taken in fp64 from the fp32 correction, then rounded.
    step_size = (lr / correction1.to(tl.float32).to(tl.float64)).to(tl.float32)
    correction2_sqrt = tl.sqrt(correction2).to(tl.float32)
    keep1, take1 = beta1.to(tl.float32), (1.0 - beta1).to(tl.float32)
    keep2, take2 = beta2.to(tl.float32), (1.0 - beta2).to(tl.float32)
    eps32 = eps.to(tl.float32)

    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        grad = -grad
    if DECAY:
        param = param - (lr * weight_decay).to(tl.float32) * param
    exp_avg = keep1 * exp_avg + take1 * grad
    exp_avg_sq = keep2 * exp_avg_sq + take2 * grad * grad
    # IEEE-rounded division and square root (Triton's defaults on the GPU are approximate): the kernel is bound by
    # memory, and the rounding then matches torch's.
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), correction2_sqrt) + eps32
    param = param - tl.div_rn(step_size * exp_avg, denom)
    tl.store(param_ptr + offsets, _cast(param, param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offsets, _cast(exp_avg, exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, _cast(exp_avg_sq, exp_avg_sq_ptr.dtype.element_ty), mask=mask)
