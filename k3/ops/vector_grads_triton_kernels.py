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
                      SCALED: tl.constexpr, TWO: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """s = the sum of partials' num_rows rows [num_rows, D] (rows D apart) in fp32, in a fixed order (BLOCK_R rows
    a load, each column's lanes added up at the end); out_a = s * a (s without SCALED) and, with TWO, out_b = s * b,
    each in its own dtype (a and b [D], any float dtype). A tile of rows a load, not one row: the loop over a
    GPU's hundreds of partial rows one at a time waited on every load (6.4 ms a `small` step on one H100)."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    lanes = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for start in range(0, num_rows, BLOCK_R):
        rows = start + lanes
        mask = (rows < num_rows)[:, None] & ok[None, :]
        acc += tl.load(partials_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    out_a = total
    if SCALED:
        out_a = total * tl.load(a_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_a_ptr + cols, _cast(out_a, out_a_ptr.dtype.element_ty), mask=ok)
    if TWO:
        out_b = total * tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_b_ptr + cols, _cast(out_b, out_b_ptr.dtype.element_ty), mask=ok)
