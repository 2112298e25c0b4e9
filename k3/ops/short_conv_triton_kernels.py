"""The Triton kernels behind k3.ops.short_conv_triton (see there); a module of its own because it imports triton.

Programs tile (time, channel) blocks of one batch row. A channel block lies inside one output plane, so the
planar output [P, B, T, C / P] is written with contiguous stores along channels, as x is read. Tap j looks j
steps back and carries weight w[:, W-1-j]; it counts at time t only when t - j >= 0 and, for packed input,
position_in_doc[t] >= j. Arithmetic is fp32; results are written in their tensors' dtypes.
"""

import os

import triton
import triton.language as tl

from k3.ops.triton_support import kernel_module

# Whether this import decorated the kernels for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# fp32 to the output's dtype, rounded to nearest even in the interpreter too (k3.ops.triton_cast).
_cast = kernel_module("k3.ops.triton_cast", INTERPRETED).cast_rounded


@triton.jit
def _channels(pid, part_width, BLOCK_C: tl.constexpr):
    """Program pid's channels: (its plane, columns in the plane, channels of x, which of them exist)."""
    blocks_per_part = tl.cdiv(part_width, BLOCK_C)
    part = pid // blocks_per_part
    cols = (pid % blocks_per_part) * BLOCK_C + tl.arange(0, BLOCK_C)
    return part, cols, part * part_width + cols, cols < part_width


@triton.jit
def _tap_ok(ts, j, length, pos_ptr, HAS_POS: tl.constexpr):
    """Whether tap j counts at times ts (False past the end)."""
    ok = (ts >= j) & (ts < length)
    if HAS_POS:
        ok = ok & (tl.load(pos_ptr + ts, mask=ts < length, other=0) >= j)
    return ok


@triton.jit
def _pre_activation(x_row, w_ptr, pos_ptr, ts, cs, c_ok, length, stride_xt, stride_wc, stride_wt,
                    W: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """sum_j w[c, W-1-j] x[t-j, c] over the taps that count, fp32 [BLOCK_T, BLOCK_C] (0 past the end)."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        ok = _tap_ok(ts, j, length, pos_ptr, HAS_POS)
        x = tl.load(x_row + (ts - j).to(tl.int64)[:, None] * stride_xt + cs[None, :],
                    mask=ok[:, None] & c_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cs * stride_wc + (W - 1 - j) * stride_wt, mask=c_ok, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
    return acc


@triton.jit
def short_conv_forward(x_ptr, w_ptr, pos_ptr, y_ptr, num_rows, length, part_width, stride_xb, stride_xt,
                       stride_wc, stride_wt, W: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """y[part, b, t, col] = silu(pre[b, t, part * part_width + col]) for BLOCK_T times and BLOCK_C columns of
    one plane. The W shifted reads of x overlap, so all but one come from cache."""
    b = tl.program_id(2)
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    part, cols, cs, c_ok = _channels(tl.program_id(1), part_width, BLOCK_C)
    pre = _pre_activation(x_ptr + b.to(tl.int64) * stride_xb, w_ptr, pos_ptr, ts, cs, c_ok, length, stride_xt,
                          stride_wc, stride_wt, W, HAS_POS, BLOCK_T, BLOCK_C)
    y = pre * tl.sigmoid(pre)
    rows = (part * num_rows + b).to(tl.int64) * length + ts
    tl.store(y_ptr + rows[:, None] * part_width + cols[None, :], _cast(y, y_ptr.dtype.element_ty),
             mask=(ts < length)[:, None] & c_ok[None, :])


@triton.jit
def short_conv_backward(x_ptr, w_ptr, pos_ptr, dy_ptr, dx_ptr, dw_ptr, num_rows, length, channels, part_width,
                        tiles_per_program, stride_xb, stride_xt, stride_wc, stride_wt, W: tl.constexpr,
                        HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    """With dpre_t = dy_t silu'(pre_t), pre recomputed from x (the forward keeps no activations):

        dx[s]         = sum_j [tap j counts at s+j] w[:, W-1-j] dpre[s+j]        (written in dx's dtype)
        dw[:, W-1-j] += sum_t [tap j counts at t]  dpre[t] x[t-j]                (this program's times t)

    A program takes tiles_per_program consecutive tiles of BLOCK_T times and writes its share of dw to its own
    row of dw_ptr ([B * programs over time, C, W] fp32, summed by the launcher: deterministic, no atomics).
    Without a way to shift a tile across rows in registers, dpre at the W shifts s+j is recomputed from x for
    each j: W sigmoids and W^2 (mostly cached) reads of x per element, for reads of x and dy from memory once."""
    pid_t, b = tl.program_id(0), tl.program_id(2)
    part, cols, cs, c_ok = _channels(tl.program_id(1), part_width, BLOCK_C)
    x_row = x_ptr + b.to(tl.int64) * stride_xb
    dy_plane = dy_ptr + (part * num_rows + b).to(tl.int64) * length * part_width
    taps = tl.arange(0, BLOCK_W)
    dw = tl.zeros((BLOCK_C, BLOCK_W), dtype=tl.float32)  # column k holds w[:, k]'s gradient
    for tile in range(tiles_per_program):
        ss = (pid_t * tiles_per_program + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(W):
            ts = ss + j
            pre = _pre_activation(x_row, w_ptr, pos_ptr, ts, cs, c_ok, length, stride_xt, stride_wc, stride_wt,
                                  W, HAS_POS, BLOCK_T, BLOCK_C)
            dy = tl.load(dy_plane + ts.to(tl.int64)[:, None] * part_width + cols[None, :],
                         mask=(ts < length)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            sig = tl.sigmoid(pre)
            dpre = dy * sig * (1.0 + pre * (1.0 - sig))  # 0 past the end, where dy is
            w = tl.load(w_ptr + cs * stride_wc + (W - 1 - j) * stride_wt, mask=c_ok, other=0.0).to(tl.float32)
            dx += tl.where(_tap_ok(ts, j, length, pos_ptr, HAS_POS)[:, None], dpre, 0.0) * w[None, :]
            if j == 0:  # dpre at this program's own times: its share of dw, from the taps' x (cached reads)
                for i in tl.static_range(W):
                    ok = _tap_ok(ss, i, length, pos_ptr, HAS_POS)
                    x = tl.load(x_row + (ss - i).to(tl.int64)[:, None] * stride_xt + cs[None, :],
                                mask=ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
                    dw += tl.where(taps[None, :] == W - 1 - i, tl.sum(dpre * x, axis=0)[:, None], 0.0)
        rows = (b * length + ss).to(tl.int64)
        tl.store(dx_ptr + rows[:, None] * channels + cs[None, :], _cast(dx, dx_ptr.dtype.element_ty),
                 mask=(ss < length)[:, None] & c_ok[None, :])
    partial = dw_ptr + (b * tl.num_programs(0) + pid_t).to(tl.int64) * channels * W
    tl.store(partial + cs[:, None] * W + taps[None, :], dw, mask=c_ok[:, None] & (taps < W)[None, :])
