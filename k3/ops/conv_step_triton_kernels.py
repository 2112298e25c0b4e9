"""The Triton kernel behind k3.ops.conv_step_triton (see there); a module of its own because it imports triton."""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting

# Whether this import decorated the kernel for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = triton_interpreting()


@triton.jit
def conv_step(x_ptr, weight_ptr, window_ptr, rows_ptr, out_ptr, num_rows, channels, part_width,
              stride_xb, stride_xc, stride_wc, stride_wt, stride_ns, stride_nt, stride_nc, stride_r,
              TAPS: tl.constexpr, BLOCK_C: tl.constexpr):
    """One decode token of a depthwise causal conv with silu, for BLOCK_C channels of row b:

        y[c] = silu(sum_j window[slot, j, c] w[c, j] + x[c] w[c, TAPS - 1]),   slot = rows[b]

    summed in fp32 in the order j = 0 .. TAPS - 1 (the PyTorch twin's), written to out[c // part_width, b,
    c % part_width]; then the window slides in place: window[slot, j] = window[slot, j + 1], window[slot, last] = x.
    Each program owns its (slot, channels): every tap is read before its place is written. A window held in
    another dtype than x is read through x's dtype, as the PyTorch twin casts it (so the shifted taps too)."""
    b = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cs < channels
    slot = tl.load(rows_ptr + b * stride_r).to(tl.int64)
    window = window_ptr + slot * stride_ns + cs * stride_nc
    weights = weight_ptr + cs * stride_wc
    x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + cs * stride_xc, mask=ok, other=0.0)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for j in tl.static_range(TAPS - 1):
        tap = tl.load(window + j * stride_nt, mask=ok, other=0.0).to(x_ptr.dtype.element_ty)
        acc += tap.to(tl.float32) * tl.load(weights + j * stride_wt, mask=ok, other=0.0).to(tl.float32)
        if j > 0:  # tap j moves to j - 1, whose old value was read in the previous round
            tl.store(window + (j - 1) * stride_nt, tap.to(window_ptr.dtype.element_ty), mask=ok)
    acc += x.to(tl.float32) * tl.load(weights + (TAPS - 1) * stride_wt, mask=ok, other=0.0).to(tl.float32)
    tl.store(window + (TAPS - 2) * stride_nt, x.to(window_ptr.dtype.element_ty), mask=ok)
    y = acc * tl.sigmoid(acc)
    part = cs // part_width
    tl.store(out_ptr + (part.to(tl.int64) * num_rows + b) * part_width + cs % part_width,
             y.to(out_ptr.dtype.element_ty), mask=ok)
