"""The Triton kernels behind k3.ops.glu_triton (see there); a module of its own because it imports triton.

Tiles of BLOCK_N rows x BLOCK_F columns over [N, F]; the inputs are read through their row strides (columns
contiguous), the outputs are contiguous. Everything is computed in fp32 and written in the outputs' dtypes.
"""

import os

import triton
import triton.language as tl

from k3.ops.triton_support import kernel_module

# Whether this import decorated the kernels for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_cast = kernel_module("k3.ops.triton_cast", INTERPRETED).cast_rounded


@triton.jit
def _sigmoid(x):
    """1 / (1 + exp(-x)) from exp(-|x|), which never overflows."""
    z = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0, z) / (1.0 + z)


@triton.jit
def _tanh_and_sech2(x):
    """(tanh(x), 1 - tanh(x)^2) from e = exp(-2|x|): tanh|x| = (1 - e) / (1 + e), sech^2 = 4e / (1 + e)^2.
    The second is not 1 - t*t: that cancels where |tanh| nears 1, the soft cap's whole range. 1 - e cancels
    near 0 instead (1e-4 relative at |x| = 2.5e-4), so there tanh is its series to x^7 (error below 1e-9
    relative for |x| < 1/8)."""
    e = tl.exp(-2.0 * tl.abs(x))
    r = 1.0 / (1.0 + e)
    t = (1.0 - e) * r
    t = tl.where(x < 0, -t, t)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.125, series, t), 4.0 * e * r * r


@triton.jit
def _tile(pid_n, pid_f, num_rows, F: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < num_rows)[:, None] & (cols < F)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def glu_forward(gate_ptr, up_ptr, h_ptr, num_rows, stride_g, stride_u, F: tl.constexpr, SITU: tl.constexpr,
                beta_gate, beta_up, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """h = act(gate, up):  SiTU  beta_g*tanh(g/beta_g)*sigmoid(g) * beta_u*tanh(u/beta_u),  SiLU  g*sigmoid(g)*u."""
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), num_rows, F, BLOCK_N, BLOCK_F)
    g = tl.load(gate_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(g)
    if SITU:
        t_g, _ = _tanh_and_sech2(g / beta_gate)
        t_u, _ = _tanh_and_sech2(u / beta_up)
        h = (beta_gate * t_g * s) * (beta_up * t_u)
    else:
        h = g * s * u
    tl.store(h_ptr + rows * F + cols, _cast(h, h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_backward(dh_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, num_rows, stride_dh, stride_g, stride_u,
                 F: tl.constexpr, SITU: tl.constexpr, beta_gate, beta_up, BLOCK_N: tl.constexpr,
                 BLOCK_F: tl.constexpr):
    """With h = A(g) * B(u): dgate = dh * B * A'(g), dup = dh * A * B'(u), the activation recomputed from gate
    and up.  SiTU: A = beta_g*tanh(g/beta_g)*s, A' = sech^2(g/beta_g)*s + beta_g*tanh(g/beta_g)*s*(1 - s),
    B = beta_u*tanh(u/beta_u), B' = sech^2(u/beta_u).  SiLU: A = g*s, A' = s*(1 + g*(1 - s)), B = u, B' = 1."""
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), num_rows, F, BLOCK_N, BLOCK_F)
    dh = tl.load(dh_ptr + rows * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(g)
    if SITU:
        t_g, sech2_g = _tanh_and_sech2(g / beta_gate)
        t_u, sech2_u = _tanh_and_sech2(u / beta_up)
        capped_g = beta_gate * t_g
        a = capped_g * s
        da = sech2_g * s + capped_g * s * (1.0 - s)
        b = beta_up * t_u
        db = sech2_u
    else:
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
        b = u
        db = 1.0
    tl.store(dgate_ptr + rows * F + cols, _cast(dh * b * da, dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows * F + cols, _cast(dh * a * db, dup_ptr.dtype.element_ty), mask=mask)
