"""The Triton kernels behind k3.ops.glu_triton (see there); a module of its own because it imports triton.

Tiles of BLOCK_N rows x BLOCK_F columns over [N, F]; the inputs are read through their row strides (columns
contiguous), the outputs are contiguous. Everything is computed in fp32 and written in the outputs' dtypes.
"""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting
from k3.ops.triton_support import kernel_module

# Whether this import decorated the kernels for Triton's CPU interpreter (the launcher reloads on a change).
INTERPRETED = triton_interpreting()
_cast = kernel_module("k3.ops.triton_cast", INTERPRETED).cast_rounded


_FAST_RECIPROCAL = tl.constexpr(not INTERPRETED)


@triton.jit
def _reciprocal(x):
    """1 / x for x in [1, 8]: one approximate reciprocal instruction on the GPU (rcp.approx, about 1 ulp), where
    a division rounded as IEEE asks is a sequence of several; plain division in the interpreter."""
    if _FAST_RECIPROCAL:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def _tanh_series(x, t):
    """tanh from (1 - e) / (1 + e) cancels near 0 (1e-4 relative at |x| = 2.5e-4): there, its series to x^7
    (error below 1e-9 relative for |x| < 1/8)."""
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.125, series, t)


@triton.jit
def _situ_parts(g, u, inv_beta_gate, inv_beta_up, GATE_BETA_4: tl.constexpr):
    """(s, s(1 - s), tanh(g/beta_g), sech^2(g/beta_g), tanh(u/beta_u), sech^2(u/beta_u)) with s = sigmoid(g);
    s(1 - s) = exp(-|g|) / (1 + exp(-|g|))^2, which does not cancel where s nears 1.

    With e = exp(-2|x|): tanh|x| = (1 - e) / (1 + e) and sech^2 x = 4e / (1 + e)^2 (not 1 - tanh^2, which
    cancels where |tanh| nears 1, the soft cap's whole range); sigmoid|g| = 1 / (1 + exp(-|g|)). No exp of a
    positive argument, so nothing overflows. The three reciprocals come from one (the denominators lie in [1, 2]
    each), and for beta_g = 4 (GATE_BETA_4) exp(-|g|) is the square of tanh's exp(-|g|/2): two exponentials and
    one reciprocal an element, so that memory bounds the kernels rather than the GPU's special-function units."""
    a = g * inv_beta_gate
    b = u * inv_beta_up
    e_g = tl.exp(-2.0 * tl.abs(a))
    if GATE_BETA_4:
        e_s = e_g * e_g
    else:
        e_s = tl.exp(-tl.abs(g))
    e_u = tl.exp(-2.0 * tl.abs(b))
    den_g, den_s, den_u = 1.0 + e_g, 1.0 + e_s, 1.0 + e_u
    r = _reciprocal(den_g * den_s * den_u)
    r_g, r_s, r_u = den_s * den_u * r, den_g * den_u * r, den_g * den_s * r
    t_g = (1.0 - e_g) * r_g
    t_u = (1.0 - e_u) * r_u
    s = tl.where(g >= 0, 1.0, e_s) * r_s
    t_g = _tanh_series(a, tl.where(a < 0, -t_g, t_g))
    t_u = _tanh_series(b, tl.where(b < 0, -t_u, t_u))
    return s, e_s * r_s * r_s, t_g, 4.0 * e_g * r_g * r_g, t_u, 4.0 * e_u * r_u * r_u


@triton.jit
def _sigmoid(x):
    """(s, s(1 - s)) for s = 1 / (1 + exp(-x)), both from z = exp(-|x|), which never overflows:
    s(1 - s) = z / (1 + z)^2."""
    z = tl.exp(-tl.abs(x))
    r = _reciprocal(1.0 + z)
    return tl.where(x >= 0, 1.0, z) * r, z * r * r


@triton.jit
def _tile(pid_n, pid_f, num_rows, F: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < num_rows)[:, None] & (cols < F)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def glu_forward(gate_ptr, up_ptr, h_ptr, num_rows, stride_g, stride_u, F: tl.constexpr, SITU: tl.constexpr,
                beta_gate, beta_up, GATE_BETA_4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """h = act(gate, up):  SiTU  beta_g*tanh(g/beta_g)*sigmoid(g) * beta_u*tanh(u/beta_u),  SiLU  g*sigmoid(g)*u."""
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), num_rows, F, BLOCK_N, BLOCK_F)
    g = tl.load(gate_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if SITU:
        s, _, t_g, _, t_u, _ = _situ_parts(g, u, 1.0 / beta_gate, 1.0 / beta_up, GATE_BETA_4)
        h = (beta_gate * t_g * s) * (beta_up * t_u)
    else:
        s, _ = _sigmoid(g)
        h = g * s * u
    tl.store(h_ptr + rows * F + cols, _cast(h, h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_backward(dh_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, num_rows, stride_dh, stride_g, stride_u,
                 F: tl.constexpr, SITU: tl.constexpr, beta_gate, beta_up, GATE_BETA_4: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """With h = A(g) * B(u): dgate = dh * B * A'(g), dup = dh * A * B'(u), the activation recomputed from gate
    and up.  SiTU: A = beta_g*tanh(g/beta_g)*s, A' = sech^2(g/beta_g)*s + beta_g*tanh(g/beta_g)*s*(1 - s),
    B = beta_u*tanh(u/beta_u), B' = sech^2(u/beta_u).  SiLU: A = g*s, A' = s + g*s*(1 - s), B = u, B' = 1."""
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), num_rows, F, BLOCK_N, BLOCK_F)
    dh = tl.load(dh_ptr + rows * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if SITU:
        s, s_ds, t_g, sech2_g, t_u, sech2_u = _situ_parts(g, u, 1.0 / beta_gate, 1.0 / beta_up, GATE_BETA_4)
        capped_g = beta_gate * t_g
        a = capped_g * s
        da = sech2_g * s + capped_g * s_ds
        b = beta_up * t_u
        db = sech2_u
    else:
        s, s_ds = _sigmoid(g)
        a = g * s
        da = s + g * s_ds
        b = u
        db = 1.0
    tl.store(dgate_ptr + rows * F + cols, _cast(dh * b * da, dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows * F + cols, _cast(dh * a * db, dup_ptr.dtype.element_ty), mask=mask)
