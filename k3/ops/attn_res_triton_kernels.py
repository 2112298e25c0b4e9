"""The Triton kernels behind k3.ops.attn_res_triton (see there); a module of its own because it imports triton.

Sources come as a tuple of S pointers (S a constexpr, unrolled by tl.static_range), each a contiguous [N, D]
tensor read in place; per-(token, source) statistics live in a [BLOCK_N, S_PAD] tile, S_PAD = next power of two,
whose padding columns are masked out of the softmax and never stored. Everything is computed in fp32.
"""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting
from k3.ops.triton_support import kernel_module

# Whether this import decorated the kernels for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = triton_interpreting()
# fp32 to the output's dtype, rounded to nearest even in the interpreter too (k3.ops.triton_cast).
_cast = kernel_module("k3.ops.triton_cast", INTERPRETED).cast_rounded


@triton.jit
def _column(tile, cols, i):
    """Column i of a [BLOCK_N, S_PAD] tile as a [BLOCK_N, 1] block (a masked sum: tiles cannot be indexed)."""
    return tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)[:, None]


@triton.jit
def attn_res_forward(srcs, q_ptr, out_ptr, alpha_ptr, inv_rms_ptr, dot_ptr, num_rows, eps,
                     D: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, SAVE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """BLOCK_N token rows per program. Pass 1 over D: each source's sum of squares and dot with q; then the
    scores and their softmax over sources; pass 2 over D re-reads the sources (this program's rows, still in L2)
    and writes the mix in out's dtype. With SAVE, alpha, 1/rms and v.q go to [N, S] fp32 for the backward."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    row_off = rows.to(tl.int64)[:, None] * D
    cols = tl.arange(0, S_PAD)
    ds = tl.arange(0, BLOCK_D)
    sumsq = tl.zeros((BLOCK_N, S_PAD), dtype=tl.float32)
    dot = tl.zeros((BLOCK_N, S_PAD), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_ok = (d0 + ds) < D
        mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + d0 + ds, mask=d_ok, other=0.0)[None, :]
        for i in tl.static_range(S):
            v = tl.load(srcs[i] + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
            sumsq = tl.where(cols[None, :] == i, sumsq + tl.sum(v * v, axis=1)[:, None], sumsq)
            dot = tl.where(cols[None, :] == i, dot + tl.sum(v * q, axis=1)[:, None], dot)
    inv_rms = tl.rsqrt(sumsq / D + eps)
    scores = tl.where(cols[None, :] < S, dot * inv_rms, float("-inf"))
    weights = tl.exp(scores - tl.max(scores, axis=1)[:, None])
    alpha = weights / tl.sum(weights, axis=1)[:, None]
    if SAVE:
        stat_off = rows[:, None] * S + cols[None, :]
        stat_ok = row_ok[:, None] & (cols[None, :] < S)
        tl.store(alpha_ptr + stat_off, alpha, mask=stat_ok)
        tl.store(inv_rms_ptr + stat_off, inv_rms, mask=stat_ok)
        tl.store(dot_ptr + stat_off, dot, mask=stat_ok)
    for d0 in range(0, D, BLOCK_D):
        d_ok = (d0 + ds) < D
        mask = row_ok[:, None] & d_ok[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        for i in tl.static_range(S):
            v = tl.load(srcs[i] + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += _column(alpha, cols, i) * v
        tl.store(out_ptr + row_off + (d0 + ds)[None, :], _cast(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def attn_res_backward(srcs, grads, g_ptr, q_ptr, alpha_ptr, inv_rms_ptr, dot_ptr, dq_ptr, num_rows,
                      blocks_per_program, D: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
                      ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """g = dmix. Per row, with alpha, r = 1/rms and dot = v.q saved by the forward:
        da_i = g . v_i,   ds_i = alpha_i (da_i - sum_j alpha_j da_j)
        dv_i = alpha_i g + ds_i (r_i q - dot_i r_i^3 v_i / D)        (written to grads[i] in its dtype)
        dq  += sum over rows and sources of ds_i r_i v_i
    Bit i of ACC set: grads[i] already holds a gradient of source i (from later mixes), and dv_i is added to it
    in fp32 and rounded once, where autograd would round dv_i and add the two in a kernel of its own.
    A program takes blocks_per_program consecutive blocks of BLOCK_N rows and sums its share of dq into its own
    row of dq_ptr ([programs, D] fp32, zeroed by the program itself, summed by the launcher): no atomics, so dq is
    deterministic, and few programs keep that buffer small."""
    pid = tl.program_id(0)
    cols = tl.arange(0, S_PAD)
    ds = tl.arange(0, BLOCK_D)
    col_ok = cols[None, :] < S
    # Every block of rows adds into the program's row of dq_ptr, so it starts at zero (here, not as a launch).
    for d0 in range(0, D, BLOCK_D):
        tl.store(dq_ptr + pid.to(tl.int64) * D + d0 + ds, tl.zeros((BLOCK_D,), dtype=tl.float32), mask=(d0 + ds) < D)
    for block in range(0, blocks_per_program):
        rows = (pid * blocks_per_program + block) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < num_rows
        row_off = rows.to(tl.int64)[:, None] * D
        da = tl.zeros((BLOCK_N, S_PAD), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            mask = row_ok[:, None] & ((d0 + ds) < D)[None, :]
            g = tl.load(g_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
            for i in tl.static_range(S):
                v = tl.load(srcs[i] + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                da = tl.where(cols[None, :] == i, da + tl.sum(g * v, axis=1)[:, None], da)
        stat_off = rows[:, None] * S + cols[None, :]
        stat_ok = row_ok[:, None] & col_ok
        alpha = tl.load(alpha_ptr + stat_off, mask=stat_ok, other=0.0)
        inv_rms = tl.load(inv_rms_ptr + stat_off, mask=stat_ok, other=0.0)
        dot = tl.load(dot_ptr + stat_off, mask=stat_ok, other=0.0)
        dscore = alpha * (da - tl.sum(alpha * da, axis=1)[:, None])
        coef_q = dscore * inv_rms  # of q in dv_i, and of v_i in dq
        coef_v = -dscore * dot * inv_rms * inv_rms * inv_rms / D
        for d0 in range(0, D, BLOCK_D):
            d_ok = (d0 + ds) < D
            mask = row_ok[:, None] & d_ok[None, :]
            g = tl.load(g_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + d0 + ds, mask=d_ok, other=0.0)[None, :]
            dq = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)  # summed over rows once, not once per source
            for i in tl.static_range(S):
                v = tl.load(srcs[i] + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                c_q = _column(coef_q, cols, i)
                dv = _column(alpha, cols, i) * g + c_q * q + _column(coef_v, cols, i) * v
                if (ACC >> i) & 1:
                    dv += tl.load(grads[i] + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                tl.store(grads[i] + row_off + (d0 + ds)[None, :], _cast(dv, grads[i].dtype.element_ty), mask=mask)
                dq += c_q * v
            # This program's own row of the buffer; the barrier orders its threads' store of the previous block's
            # sum before this load (the two need not be made by the same thread).
            tl.debug_barrier()
            partial = dq_ptr + pid.to(tl.int64) * D + d0 + ds
            tl.store(partial, tl.load(partial, mask=d_ok, other=0.0) + tl.sum(dq, axis=0), mask=d_ok)
