"""The Triton kernels behind k3.ops.short_conv_triton (see there); a module of its own because it imports triton.

A program owns BLOCK_C channels of one batch row over BLOCK_T consecutive times and walks them in time order,
ROWS rows a step: each row of x (and dy) is read from memory once, and what the next rows need of the earlier
ones stays in registers as tuples of [BLOCK_C] rows: the last W-1 inputs (`history`) and, backward, the W-1 rows
of dx still waiting for contributions from later times (`pending`). A shift across rows of a register tile is
what Triton cannot express; rows kept as separate values need no shift. Every thread owns its channels through
time, so dweight accumulates per thread with no reduction inside the kernel.

Tap j looks j steps back and carries w[:, W-1-j]; in packed input it counts at time t only when
position_in_doc[t] >= j. Unpacked, the zeros read before t = 0 are all the masking there is. Arithmetic is fp32;
results are written in their tensors' dtypes, rounded to nearest even (k3.ops.triton_cast).

Parts: x's C channels may be PARTS equal column blocks (q, k, v side by side) whose outputs and output gradients
are separate tensors. Grid axis 1 then enumerates PARTS x cdiv(C / PARTS, BLOCK_C) channel blocks; a program's
part is a scalar, so its block of channels stays contiguous in every tensor, and it picks its part's y (dy)
pointer and strides among up to MAX_PARTS arguments once, before its loop. dx and dweight are joined, [B, T, C]
and [tiles, W, C].
"""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting
from k3.ops.triton_support import kernel_module

# Whether this import decorated the kernels for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = triton_interpreting()
_cast = kernel_module("k3.ops.triton_cast", INTERPRETED).cast_rounded


@triton.jit
def _sigmoid_parts(p):
    """(sigmoid(p), sigmoid(p)(1 - sigmoid(p))) from z = exp(-|p|), which never overflows; s(1 - s) = z / (1+z)^2
    does not cancel where s nears 1. One exponential and one approximate division (div.full, 2 ulp): the
    backward is bound by memory only while its one transcendental pair an element stays this cheap."""
    z = tl.exp(-tl.abs(p))
    r = tl.fdiv(tl.full(p.shape, 1.0, tl.float32), 1.0 + z, ieee_rounding=False)
    return tl.where(p >= 0, r, z * r), z * r * r


@triton.jit
def _of_part(part, v0, v1, v2, v3, PARTS: tl.constexpr):
    """v0 .. v3 (pointers or strides of up to four parts) at the scalar int64 `part`. Each candidate is made a
    tensor (+ 0 * part: int64 for an int) so that both sides of the runtime branch have one type, also where
    Triton specialised an int argument into a constant (a stride of 1) or typed a large one int64."""
    v = v0 + 0 * part
    if PARTS > 1:
        if part == 1:
            v = v1 + 0 * part
    if PARTS > 2:
        if part == 2:
            v = v2 + 0 * part
    if PARTS > 3:
        if part == 3:
            v = v3 + 0 * part
    return v


@triton.jit
def _taps(w_ptr, cs, c_ok, stride_wc, stride_wk, W: tl.constexpr):
    """(w[cs, W-1], w[cs, W-2], ..., w[cs, 0]) in fp32: element j is tap j's weight."""
    taps = ()
    for j in tl.static_range(W):
        taps = taps + (tl.load(w_ptr + cs * stride_wc + (W - 1 - j) * stride_wk, mask=c_ok, other=0.0)
                       .to(tl.float32),)
    return taps


@triton.jit
def _channels_if(cs, channels, ok):
    """The channel mask for a row where the scalar `ok` holds, all False elsewhere. The scalar goes into the
    bound rather than into an `&` with the vector: Triton's interpreter broadcasts a scalar bool to integers,
    which tl.load then refuses as a mask."""
    return cs < tl.where(ok, channels, 0)


@triton.jit
def _load_rows(row0_ptr, t, count: tl.constexpr, length, stride_t, cs, channels):
    """Rows t .. t+count-1 of a [T, C] plane (row0_ptr: its row 0 at this program's channels) as a tuple of
    [BLOCK_C] fp32 values; zeros outside [0, length)."""
    rows = ()
    for r in tl.static_range(count):
        time = t + r
        ok = _channels_if(cs, channels, (time >= 0) & (time < length))
        rows = rows + (tl.load(row0_ptr + time.to(tl.int64) * stride_t, mask=ok, other=0.0).to(tl.float32),)
    return rows


@triton.jit
def _position(pos_ptr, time, length, PACKED: tl.constexpr):
    """The position of `time` in its document (0 past the end)."""
    if PACKED:
        return tl.load(pos_ptr + time, mask=time < length, other=0)
    else:
        return time


@triton.jit
def _inputs_at(window, r: tl.constexpr, pos, W: tl.constexpr, PACKED: tl.constexpr):
    """The W inputs row r of `window` (W-1 earlier rows, then the step's rows) sees: element j is x_{t-j},
    zero where tap j would reach before the document's start."""
    inputs = ()
    for j in tl.static_range(W):
        x = window[W - 1 + r - j]
        if PACKED and j > 0:
            x = tl.where(pos >= j, x, 0.0)
        inputs = inputs + (x,)
    return inputs


@triton.jit
def _pre_activation(inputs, taps, W: tl.constexpr):
    pre = inputs[0] * taps[0]
    for j in tl.static_range(1, W):
        pre += inputs[j] * taps[j]
    return pre


@triton.jit
def _program_channels(channels, BLOCK_C: tl.constexpr):
    """(part, this program's channels within the part) from grid axis 1 = parts x channel blocks."""
    blocks = tl.cdiv(channels, BLOCK_C)
    pid_c = tl.program_id(1)
    return (pid_c // blocks).to(tl.int64), (pid_c % blocks) * BLOCK_C + tl.arange(0, BLOCK_C)


@triton.jit
def short_conv_forward(x_ptr, w_ptr, pos_ptr, y0_ptr, y1_ptr, y2_ptr, y3_ptr, length, channels, stride_xb,
                       stride_xt, stride_wc, stride_wk, stride_yb, stride_yt, W: tl.constexpr,
                       PACKED: tl.constexpr, PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                       ROWS: tl.constexpr):
    """y[b, t, c] = silu(sum_j w[c, W-1-j] x[b, t-j, c]) for this program's BLOCK_T times and BLOCK_C channels
    of one part (`channels` a part; x and w hold PARTS x channels); each part's y [B, T, channels] has the
    strides given (one set for all parts). ROWS divides BLOCK_T."""
    t0 = tl.program_id(0) * BLOCK_T
    part, cs = _program_channels(channels, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    c_ok = cs < channels
    x_row0 = x_ptr + b * stride_xb + part * channels + cs
    y_row0 = _of_part(part, y0_ptr, y1_ptr, y2_ptr, y3_ptr, PARTS) + b * stride_yb + cs
    taps = _taps(w_ptr + part * channels * stride_wc, cs, c_ok, stride_wc, stride_wk, W)
    history = _load_rows(x_row0, t0 - (W - 1), W - 1, length, stride_xt, cs, channels)
    for step in range(0, tl.minimum(BLOCK_T, length - t0), ROWS):
        t = t0 + step
        window = history + _load_rows(x_row0, t, ROWS, length, stride_xt, cs, channels)
        for r in tl.static_range(ROWS):
            pos = _position(pos_ptr, t + r, length, PACKED)
            pre = _pre_activation(_inputs_at(window, r, pos, W, PACKED), taps, W)
            y = pre * _sigmoid_parts(pre)[0]
            tl.store(y_row0 + (t + r).to(tl.int64) * stride_yt, _cast(y, y0_ptr.dtype.element_ty),
                     mask=_channels_if(cs, channels, t + r < length))
        history = window[ROWS:]


@triton.jit
def _backward_row(window, r: tl.constexpr, dy, pos, taps, pending, W: tl.constexpr, PACKED: tl.constexpr):
    """One time t of the backward: (its inputs x_{t-j}, dpre_t, dx of time t-W+1 now complete, the new
    pending rows). pending holds dx of times t-W+1 .. t-1 summed over the later times seen so far; time t adds
    w[:, W-1-j] dpre_t to time t-j where tap j counts."""
    inputs = _inputs_at(window, r, pos, W, PACKED)
    pre = _pre_activation(inputs, taps, W)
    s, s_ds = _sigmoid_parts(pre)
    dpre = dy * (s + pre * s_ds)  # silu'(p) = s + p s (1 - s)
    rows = ()
    for k in tl.static_range(W - 1):  # pending[k] is time t-W+1+k, reached by tap W-1-k
        contribution = taps[W - 1 - k] * dpre
        if PACKED:
            contribution = tl.where(pos >= W - 1 - k, contribution, 0.0)
        rows = rows + (pending[k] + contribution,)
    rows = rows + (taps[0] * dpre,)
    return inputs, dpre, rows[0], rows[1:]


@triton.jit
def short_conv_backward(x_ptr, w_ptr, pos_ptr, dy0_ptr, dy1_ptr, dy2_ptr, dy3_ptr, dx_ptr, dw_ptr, length,
                        channels, stride_xb, stride_xt, stride_dyb0, stride_dyb1, stride_dyb2, stride_dyb3,
                        stride_dyt0, stride_dyt1, stride_dyt2, stride_dyt3, stride_dxb, stride_dxt, stride_wc,
                        stride_wk, W: tl.constexpr, PACKED: tl.constexpr, PARTS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
    """With pre recomputed from x and dpre_t = dy_t silu'(pre_t):

        dx[b, s, c]      = sum_j [tap j counts at s+j] w[c, W-1-j] dpre[b, s+j, c]
        dw[tile, W-1-j, c] = sum_{t in this tile} [tap j counts at t] x[b, t-j, c] dpre[b, t, c]

    `channels` is a part's (x, w, dx and dw hold PARTS x channels; each part's dy has strides of its own, dx
    those given). tile = b * cdiv(T, BLOCK_T) + the program's time block; dw_ptr is [tiles, W, PARTS x
    channels] fp32, summed by the launcher (deterministic, no atomics). dx of the tile's last W-1 times needs
    dpre of the next W-1 times: after its own rows a program walks W-1 more (reading x and dy there, adding to
    dx only), so each program recomputes W-1 rows of another's pre-activation, and none writes what another
    writes."""
    pid_t = tl.program_id(0)
    t0 = pid_t * BLOCK_T
    part, cs = _program_channels(channels, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    c_ok = cs < channels
    x_row0 = x_ptr + b * stride_xb + part * channels + cs
    stride_dyt = _of_part(part, stride_dyt0, stride_dyt1, stride_dyt2, stride_dyt3, PARTS)
    dy_row0 = (_of_part(part, dy0_ptr, dy1_ptr, dy2_ptr, dy3_ptr, PARTS)
               + b * _of_part(part, stride_dyb0, stride_dyb1, stride_dyb2, stride_dyb3, PARTS) + cs)
    dx_row0 = dx_ptr + b * stride_dxb + part * channels + cs
    taps = _taps(w_ptr + part * channels * stride_wc, cs, c_ok, stride_wc, stride_wk, W)
    history = _load_rows(x_row0, t0 - (W - 1), W - 1, length, stride_xt, cs, channels)
    zero = tl.zeros((BLOCK_C,), dtype=tl.float32)
    pending = ()
    for _ in tl.static_range(W - 1):
        pending = pending + (zero,)
    dw = ()
    for _ in tl.static_range(W):
        dw = dw + (zero,)
    rows_here = tl.minimum(BLOCK_T, length - t0)
    for step in range(0, rows_here, ROWS):
        t = t0 + step
        window = history + _load_rows(x_row0, t, ROWS, length, stride_xt, cs, channels)
        dys = _load_rows(dy_row0, t, ROWS, length, stride_dyt, cs, channels)
        for r in tl.static_range(ROWS):
            pos = _position(pos_ptr, t + r, length, PACKED)
            inputs, dpre, done, pending = _backward_row(window, r, dys[r], pos, taps, pending, W, PACKED)
            sums = ()
            for j in tl.static_range(W):
                sums = sums + (dw[j] + inputs[j] * dpre,)  # zero past the end, where dy is
            dw = sums
            s = t + r - (W - 1)
            tl.store(dx_row0 + s.to(tl.int64) * stride_dxt, _cast(done, dx_ptr.dtype.element_ty),
                     mask=_channels_if(cs, channels, (s >= t0) & (s < length)))
        history = window[ROWS:]
    # The next W-1 times complete this tile's last W-1 rows of dx (zeros past the end of the sequence).
    t = t0 + tl.cdiv(rows_here, ROWS) * ROWS
    window = history + _load_rows(x_row0, t, W - 1, length, stride_xt, cs, channels)
    dys = _load_rows(dy_row0, t, W - 1, length, stride_dyt, cs, channels)
    for r in tl.static_range(W - 1):
        pos = _position(pos_ptr, t + r, length, PACKED)
        _, _, done, pending = _backward_row(window, r, dys[r], pos, taps, pending, W, PACKED)
        s = t + r - (W - 1)
        tl.store(dx_row0 + s.to(tl.int64) * stride_dxt, _cast(done, dx_ptr.dtype.element_ty),
                 mask=_channels_if(cs, channels, (s >= t0) & (s < length)))
    tile = b * tl.num_programs(0) + pid_t
    dw_row0 = dw_ptr + tile * W * PARTS * channels + part * channels + cs
    for j in tl.static_range(W):
        tl.store(dw_row0 + (W - 1 - j) * PARTS * channels, dw[j], mask=c_ok)
