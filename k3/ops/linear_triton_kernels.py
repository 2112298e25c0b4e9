"""The Triton kernel behind k3.ops.linear_triton (see there); a module of its own because it imports triton."""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting

# Whether this import decorated the kernel for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = triton_interpreting()


@triton.jit
def skinny_matmul(x_ptr, w_ptr, out_ptr, num_rows, stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
                  stride_on, out_width: tl.constexpr, in_width: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [M, N] = x [M, K] W[N, K]^T for a few rows M <= BLOCK_M: one program per BLOCK_N output columns
    streams its [BLOCK_N, K] slice of W once (fp32 accumulation)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_width
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_width, BLOCK_K):
        k_ok = (k0 + ks) < in_width
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :] * stride_wk,
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter multiplies fp32 only
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
