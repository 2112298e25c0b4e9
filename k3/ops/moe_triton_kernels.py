"""The Triton kernel behind k3.ops.moe_triton (see there); a module of its own because it imports triton."""

import os

import triton
import triton.language as tl

# Whether this import decorated the kernel for Triton's CPU interpreter (moe_triton reloads on a change).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def expert_matmul(x_ptr, w_ptr, w3_ptr, out_ptr, counts_ptr,
                  stride_xn, stride_xd, stride_we, stride_wo, stride_wd, stride_3e, stride_3o, stride_3d,
                  stride_on, stride_oo, beta_gate, beta_up, out_width: tl.constexpr, in_width: tl.constexpr,
                  NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                  GLU: tl.constexpr, SITU: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.program_id(0)
    # The expert's rows start after every earlier expert's: a prefix sum over the counts, here rather than in a
    # cumsum kernel of its own (two fewer launches per MoE layer in a decode step that is launch-bound).
    others = tl.arange(0, EXPERTS_POW2)
    counts = tl.load(counts_ptr + others, mask=others < NUM_EXPERTS, other=0).to(tl.int32)
    start = tl.sum(tl.where(others < expert, counts, 0), axis=0)
    end = start + tl.load(counts_ptr + expert).to(tl.int32)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_width
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wo
    w3_rows = w3_ptr + expert.to(tl.int64) * stride_3e + cols[:, None] * stride_3o
    # A while loop, not range(start, end): Triton's CPU interpreter cannot take loaded loop bounds.
    row0 = start
    while row0 < end:  # no iteration for an expert with no rows: nothing is read
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, in_width, BLOCK_K):
            k_ok = (k0 + ks) < in_width
            x = tl.load(x_ptr + rows[:, None] * stride_xn + (k0 + ks)[None, :] * stride_xd,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + (k0 + ks)[None, :] * stride_wd, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:  # the CPU interpreter multiplies fp32 only
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w))
            if GLU:
                w3 = tl.load(w3_rows + (k0 + ks)[None, :] * stride_3d, mask=col_ok[:, None] & k_ok[None, :],
                             other=0.0)
                if UPCAST:
                    w3 = w3.to(tl.float32)
                acc3 += tl.dot(x, tl.trans(w3))
        if GLU:
            if SITU:  # beta_g tanh(g / beta_g) sigmoid(g) * beta_u tanh(u / beta_u); tanh(z) = 2 sigmoid(2z) - 1
                tanh_g = 2.0 * tl.sigmoid(2.0 * acc / beta_gate) - 1.0
                tanh_u = 2.0 * tl.sigmoid(2.0 * acc3 / beta_up) - 1.0
                acc = (beta_gate * tanh_g * tl.sigmoid(acc)) * (beta_up * tanh_u)
            else:  # silu(g) * u
                acc = acc * tl.sigmoid(acc) * acc3
        tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :] * stride_oo,
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        row0 += BLOCK_M
