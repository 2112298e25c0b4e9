"""The Triton kernel behind k3.ops.master_adamw (see there); a module of its own because it imports triton.

One program per BLOCK elements of one tensor of a list. A block map gives each program its tensor and its block
within it; the tensor's row of a table gives where its six tensors lie (bf16 parameter and gradient, fp32 master,
exp_avg and exp_avg_sq, the fp32 step count) as element offsets from two base pointers, and its element count.
Offsets from typed, aligned arguments rather than raw addresses: the compiler then knows the alignment and issues
16-byte accesses (through an address loaded and cast to a pointer it issued 2- and 4-byte ones, sm_90 PTX). The
parameter is written, never read: it is the master rounded.
"""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting
from k3.ops.triton_support import kernel_module

# Whether this import decorated the kernel for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = triton_interpreting()
_cast = kernel_module("k3.ops.triton_cast", INTERPRETED).cast_rounded
_bias_corrections = kernel_module("k3.ops.adamw_triton_kernels", INTERPRETED)._bias_corrections

# Columns of a tensor's row in the table (k3.ops.master_adamw.TABLE_COLUMNS names them).
_PARAM, _GRAD, _MASTER, _EXP_AVG, _EXP_AVG_SQ, _STEP, _NUMEL = (tl.constexpr(i) for i in range(7))
_COLUMNS = tl.constexpr(7)


@triton.jit
def _offset(row_ptr, column: tl.constexpr, ALIGNED: tl.constexpr):
    # The launcher routes any tensor whose storage is not 16-byte aligned to the twin, so the offsets from the
    # (aligned) base arguments are multiples of 16 bytes: the hint lets the compiler issue 16-byte accesses.
    return tl.multiple_of(tl.load(row_ptr + column), ALIGNED)


@triton.jit
def _adamw(grad, master, exp_avg, exp_avg_sq, scale_ptr, step_size, correction2_sqrt, keep1, take1, keep2, take2,
           eps32, decay32, HAS_SCALE: tl.constexpr, DECAY: tl.constexpr, MAXIMIZE: tl.constexpr):
    if HAS_SCALE:
        grad = grad * tl.load(scale_ptr)
    if MAXIMIZE:
        grad = -grad
    if DECAY:
        master = master - decay32 * master
    exp_avg = keep1 * exp_avg + take1 * grad
    exp_avg_sq = keep2 * exp_avg_sq + take2 * grad * grad
    # IEEE-rounded division and square root (Triton's defaults on the GPU are approximate), as the twin's.
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), correction2_sqrt) + eps32
    master = master - tl.div_rn(step_size * exp_avg, denom)
    return master, exp_avg, exp_avg_sq


@triton.jit
def master_adamw_step(table_ptr, blocks_ptr, scale_ptr, param_base, master_base, lr: tl.float64, beta1: tl.float64,
                      beta2: tl.float64, eps: tl.float64, weight_decay: tl.float64, HAS_SCALE: tl.constexpr,
                      DECAY: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One AdamW step of a block of one master, in k3.ops.adamw_triton_kernels.adamw_step's order (torch's fused
    kernel's), its gradient read from the bf16 one and first multiplied by the clip coefficient (HAS_SCALE):

        grad = float(grad_bf16) * scale
        master -= lr * weight_decay * master                    (DECAY)
        exp_avg = beta1 * exp_avg + (1 - beta1) * grad          (grad negated under MAXIMIZE)
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
        master -= (lr / (1 - beta1^t)) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)
        param = bf16(master)                                    (rounded to nearest even)

    blocks_ptr: int32 pairs (tensor index, block of that tensor) a program. table_ptr: int64 rows of _COLUMNS, the
    parameter's and gradient's element offsets from param_base, the master's, moments' and step count's from
    master_base (fp32), then the element count. A block inside its tensor reads and writes without a mask (a
    mask bounded by a loaded count would cost the 16-byte accesses)."""
    lr, beta1, beta2 = tl.full((), lr, tl.float64), tl.full((), beta1, tl.float64), tl.full((), beta2, tl.float64)
    eps, weight_decay = tl.full((), eps, tl.float64), tl.full((), weight_decay, tl.float64)
    program = tl.program_id(0)
    tensor = tl.load(blocks_ptr + 2 * program).to(tl.int64)
    block = tl.load(blocks_ptr + 2 * program + 1).to(tl.int64)
    row_ptr = table_ptr + tensor * _COLUMNS
    param_ptr = param_base + _offset(row_ptr, _PARAM, 8)
    grad_ptr = param_base + _offset(row_ptr, _GRAD, 8)
    master_ptr = master_base + _offset(row_ptr, _MASTER, 4)
    exp_avg_ptr = master_base + _offset(row_ptr, _EXP_AVG, 4)
    exp_avg_sq_ptr = master_base + _offset(row_ptr, _EXP_AVG_SQ, 4)
    step_ptr = master_base + tl.load(row_ptr + _STEP)
    numel = tl.load(row_ptr + _NUMEL)

    correction1, correction2 = _bias_corrections(step_ptr, beta1, beta2)
    # As torch rounds them (k3.ops.adamw_triton_kernels.adamw_step says how).
    step_size = (lr / correction1.to(tl.float32).to(tl.float64)).to(tl.float32)
    correction2_sqrt = tl.sqrt(correction2).to(tl.float32)
    keep1, take1 = beta1.to(tl.float32), (1.0 - beta1).to(tl.float32)
    keep2, take2 = beta2.to(tl.float32), (1.0 - beta2).to(tl.float32)
    eps32, decay32 = eps.to(tl.float32), (lr * weight_decay).to(tl.float32)
    out_dtype = param_base.dtype.element_ty

    offsets = block * BLOCK + tl.arange(0, BLOCK)
    if (block + 1) * BLOCK <= numel:
        grad = tl.load(grad_ptr + offsets).to(tl.float32)
        master, exp_avg, exp_avg_sq = _adamw(
            grad, tl.load(master_ptr + offsets), tl.load(exp_avg_ptr + offsets), tl.load(exp_avg_sq_ptr + offsets),
            scale_ptr, step_size, correction2_sqrt, keep1, take1, keep2, take2, eps32, decay32, HAS_SCALE, DECAY,
            MAXIMIZE)
        tl.store(master_ptr + offsets, master)
        tl.store(exp_avg_ptr + offsets, exp_avg)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq)
        tl.store(param_ptr + offsets, _cast(master, out_dtype))
    else:
        mask = offsets < numel
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        master, exp_avg, exp_avg_sq = _adamw(
            grad, tl.load(master_ptr + offsets, mask=mask, other=0.0),
            tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0),
            tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0), scale_ptr, step_size, correction2_sqrt, keep1,
            take1, keep2, take2, eps32, decay32, HAS_SCALE, DECAY, MAXIMIZE)
        tl.store(master_ptr + offsets, master, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        tl.store(param_ptr + offsets, _cast(master, out_dtype), mask=mask)
