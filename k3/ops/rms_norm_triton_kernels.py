"""The Triton kernels behind k3.ops.rms_norm_triton (see there); a module of its own because it imports triton.

Rows are contiguous, D apart. A row that fits one BLOCK_D chunk (D <= BLOCK_D, the default up to D = 8192) is
loaded once and kept in registers; wider rows take two passes over their chunks, the second re-reading this
program's rows from L2. Everything is computed in fp32 and written in the tensors' own dtypes.
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
def rms_norm_forward(x_ptr, w_ptr, g_ptr, y_ptr, rstd_ptr, num_rows, eps, D: tl.constexpr, SAVE: tl.constexpr,
                     GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """BLOCK_N rows per program: rstd = rsqrt(mean(x^2) + eps), y = (x * rstd) * w (the twin's order), times
    sigmoid(g) with GATED (g [N, D] like x, any of the kernels' dtypes), y in y's dtype; with SAVE, rstd [N] fp32
    for the backward."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    row_off = rows.to(tl.int64)[:, None] * D
    ds = tl.arange(0, BLOCK_D)
    if BLOCK_D >= D:
        d_ok = ds < D
        mask = row_ok[:, None] & d_ok[None, :]
        x = tl.load(x_ptr + row_off + ds[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(w_ptr + ds, mask=d_ok, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        if GATED:
            y = y * tl.sigmoid(tl.load(g_ptr + row_off + ds[None, :], mask=mask, other=0.0).to(tl.float32))
        tl.store(y_ptr + row_off + ds[None, :], _cast(y, y_ptr.dtype.element_ty), mask=mask)
    else:
        sumsq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            mask = row_ok[:, None] & ((d0 + ds) < D)[None, :]
            x = tl.load(x_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
            sumsq += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(sumsq / D + eps)
        for d0 in range(0, D, BLOCK_D):
            d_ok = (d0 + ds) < D
            mask = row_ok[:, None] & d_ok[None, :]
            x = tl.load(x_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + d0 + ds, mask=d_ok, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * w[None, :]
            if GATED:
                g = tl.load(g_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                y = y * tl.sigmoid(g)
            tl.store(y_ptr + row_off + (d0 + ds)[None, :], _cast(y, y_ptr.dtype.element_ty), mask=mask)
    if SAVE:
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def rms_norm_backward(x_ptr, w_ptr, g_ptr, dy_ptr, rstd_ptr, dx_ptr, dg_ptr, dw_ptr, num_rows, blocks_per_program,
                      D: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per row, with x_hat = x * rstd (rstd saved by the forward):
        dx  = rstd * (dy*w - x_hat * mean(dy*w*x_hat))      (written in dx's dtype)
        dw += dy * x_hat                                     (summed over rows)
    With GATED (y = x_hat * w * s, s = sigmoid(g)) the gate's gradient is dg = dy * x_hat * w * s * (1 - s),
    written in dg's dtype, and dy * s stands for dy in the two lines above.
    A program takes blocks_per_program consecutive blocks of BLOCK_N rows and sums its share of dw into its own
    row of dw_ptr ([programs, D] fp32, written whole by the program, summed by the launcher): no atomics, so dw is
    deterministic, and few programs keep that buffer small."""
    pid = tl.program_id(0)
    ds = tl.arange(0, BLOCK_D)
    partial = dw_ptr + pid.to(tl.int64) * D
    if BLOCK_D >= D:
        d_ok = ds < D
        w = tl.load(w_ptr + ds, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        dw = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)  # summed over its rows once, at the end
        for block in range(0, blocks_per_program):
            rows = (pid * blocks_per_program + block) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < num_rows
            row_off = rows.to(tl.int64)[:, None] * D
            mask = row_ok[:, None] & d_ok[None, :]
            x = tl.load(x_ptr + row_off + ds[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row_off + ds[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
            x_hat = x * rstd
            if GATED:
                sig = tl.sigmoid(tl.load(g_ptr + row_off + ds[None, :], mask=mask, other=0.0).to(tl.float32))
                dg = dy * x_hat * w * sig * (1.0 - sig)
                tl.store(dg_ptr + row_off + ds[None, :], _cast(dg, dg_ptr.dtype.element_ty), mask=mask)
                dy = dy * sig
            dy_w = dy * w
            mean = tl.sum(dy_w * x_hat, axis=1)[:, None] / D
            dx = rstd * (dy_w - x_hat * mean)
            tl.store(dx_ptr + row_off + ds[None, :], _cast(dx, dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
        tl.store(partial + ds, tl.sum(dw, axis=0), mask=d_ok)
    else:
        # Blocks of D add into the program's row, so it starts at zero (here, not as a launch of its own).
        for d0 in range(0, D, BLOCK_D):
            tl.store(partial + d0 + ds, tl.zeros((BLOCK_D,), dtype=tl.float32), mask=(d0 + ds) < D)
        for block in range(0, blocks_per_program):
            rows = (pid * blocks_per_program + block) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < num_rows
            row_off = rows.to(tl.int64)[:, None] * D
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
            dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d_ok = (d0 + ds) < D
                mask = row_ok[:, None] & d_ok[None, :]
                x = tl.load(x_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + d0 + ds, mask=d_ok, other=0.0).to(tl.float32)[None, :]
                if GATED:
                    g = tl.load(g_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                    dy = dy * tl.sigmoid(g)
                dot += tl.sum(dy * w * (x * rstd), axis=1)
            mean = dot[:, None] / D
            for d0 in range(0, D, BLOCK_D):
                d_ok = (d0 + ds) < D
                mask = row_ok[:, None] & d_ok[None, :]
                x = tl.load(x_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + d0 + ds, mask=d_ok, other=0.0).to(tl.float32)[None, :]
                x_hat = x * rstd
                if GATED:
                    g = tl.load(g_ptr + row_off + (d0 + ds)[None, :], mask=mask, other=0.0).to(tl.float32)
                    sig = tl.sigmoid(g)
                    dg = dy * x_hat * w * sig * (1.0 - sig)
                    tl.store(dg_ptr + row_off + (d0 + ds)[None, :], _cast(dg, dg_ptr.dtype.element_ty), mask=mask)
                    dy = dy * sig
                dx = rstd * (dy * w - x_hat * mean)
                tl.store(dx_ptr + row_off + (d0 + ds)[None, :], _cast(dx, dx_ptr.dtype.element_ty), mask=mask)
                # This program's own row of the buffer; the barrier orders its threads' store of the previous
                # block's sum before this load (the two need not be made by the same thread).
                tl.debug_barrier()
                tl.store(partial + d0 + ds, tl.load(partial + d0 + ds, mask=d_ok, other=0.0)
                         + tl.sum(dy * x_hat, axis=0), mask=d_ok)
