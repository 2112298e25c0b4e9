"""The Triton kernel behind k3.ops.vector_grads (see there); a module of its own because it imports triton."""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting
from k3.ops.triton_support import kernel_module

# Whether this import decorated the kernel for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = triton_interpreting()
_cast = kernel_module("k3.ops.triton_cast", INTERPRETED).cast_rounded


@triton.jit
def summed_rows_times(partials_ptr, a_ptr, b_ptr, out_a_ptr, out_b_ptr, num_rows, D,
                      SCALED: tl.constexpr, TWO: tl.constexpr, BLOCK_D: tl.constexpr):
    """s = the sum of partials' num_rows rows [num_rows, D] (rows D apart) in fp32, row 0 first; out_a = s * a (s
    without SCALED) and, with TWO, out_b = s * b, each in its own dtype (a and b [D], any float dtype)."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for row in range(num_rows):
        total += tl.load(partials_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
    out_a = total
    if SCALED:
        out_a = total * tl.load(a_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_a_ptr + cols, _cast(out_a, out_a_ptr.dtype.element_ty), mask=ok)
    if TWO:
        out_b = total * tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_b_ptr + cols, _cast(out_b, out_b_ptr.dtype.element_ty), mask=ok)
