"""The Triton kernels behind k3.ops.moe_combine's expert-order combine and k3.ops.moe.gather_pairs' backward (see
there); a module of its own because it imports triton.

Both read rows that sit in expert order (y [N, L], N = T * TOP_K) through the inverse permutation: pair t * TOP_K + k
of token t is row inverse[t * TOP_K + k]. Each program owns BLOCK_T tokens, so it reads its tokens' K rows and
writes its tokens' outputs: no atomics, and with `inverse` a permutation every row of the backward's dy is written
by exactly one program.
"""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting

# Whether this import decorated the kernels for Triton's CPU interpreter (the launchers reload on a change).
INTERPRETED = triton_interpreting()


@triton.jit
def combine_expert_order_fwd(y_ptr, inverse_ptr, w_ptr, out_ptr, num_tokens, width, TOP_K: tl.constexpr,
                             WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    """out[t, :] = sum_k w[t, k] * y[inverse[t * K + k], :] for a [BLOCK_T, BLOCK_L] tile, fp32 accumulation;
    without WEIGHTED every w is 1 (w_ptr is not read). y [N, L] contiguous, inverse [N] int, w [T, K] contiguous;
    out [T, L] in its own dtype."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    t_ok = tokens < num_tokens
    ok = t_ok[:, None] & (cols < width)[None, :]
    pairs = tokens.to(tl.int64) * TOP_K
    acc = tl.zeros((BLOCK_T, BLOCK_L), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        rows = tl.load(inverse_ptr + pairs + k, mask=t_ok, other=0).to(tl.int64)
        y = tl.load(y_ptr + rows[:, None] * width + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + pairs + k, mask=t_ok, other=0.0).to(tl.float32)
            acc += w[:, None] * y
        else:
            acc += y
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * width + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def combine_expert_order_bwd(y_ptr, inverse_ptr, w_ptr, g_ptr, dy_ptr, dw_ptr, num_tokens, width,
                             TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    """The backward of the WEIGHTED forward for BLOCK_T tokens over the whole width: dy[inverse[t * K + k], :] =
    w[t, k] g[t, :] (in dy's dtype: dy comes out in expert order, like y) and dw[t, k] = g[t, :] . y[inverse[t * K +
    k], :] (fp32 sums, stored in w's dtype). A program owns its tokens' every column, so dw needs no reduction
    across programs."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    slots = tl.arange(0, K_POW2)
    pairs = tokens.to(tl.int64) * TOP_K
    k_ok = t_ok[:, None] & (slots < TOP_K)[None, :]
    dw = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    for l0 in range(0, width, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        ok = t_ok[:, None] & (cols < width)[None, :]
        g = tl.load(g_ptr + tokens[:, None].to(tl.int64) * width + cols[None, :], mask=ok, other=0.0)
        g = g.to(tl.float32)
        for k in tl.static_range(TOP_K):
            # Reloaded per column block: BLOCK_T small numbers that stay in L1, where keeping K of them live would
            # take the select-and-sum over a [BLOCK_T, K_POW2] tile that combine_pairs_bwd does for its weights.
            rows = tl.load(inverse_ptr + pairs + k, mask=t_ok, other=0).to(tl.int64)
            w = tl.load(w_ptr + pairs + k, mask=t_ok, other=0.0).to(tl.float32)
            offsets = rows[:, None] * width + cols[None, :]
            y = tl.load(y_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            dw = tl.where(slots[None, :] == k, dw + tl.sum(g * y, axis=1)[:, None], dw)
            tl.store(dy_ptr + offsets, (w[:, None] * g).to(dy_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_ptr + pairs[:, None] + slots[None, :], dw.to(dw_ptr.dtype.element_ty), mask=k_ok)
