"""The Triton kernels behind k3.ops.mla_decode (see there); a module of their own because they import triton."""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting

# Whether this import decorated the kernels for Triton's CPU interpreter (mla_decode reloads on a change).
INTERPRETED = triton_interpreting()


@triton.jit
def mla_decode_split(q_ptr, qr_ptr, lat_ptr, kr_ptr, mask_ptr, out_ptr, part_ptr, ml_ptr,
                     stride_qb, stride_qh, stride_qt, stride_qr,
                     stride_pb, stride_pt, stride_ph, stride_pe,
                     stride_lb, stride_ls, stride_lr,
                     stride_kb, stride_ks, stride_ke,
                     stride_mb, stride_mt, stride_ms,
                     stride_ob, stride_oh, stride_ot, stride_or,
                     length, total, visible_before, blocks_per_split, num_splits, scale_log2,
                     table_ptr, stride_tb, stride_tp, limit_ptr, stride_limit,
                     HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
                     HAS_MASK: tl.constexpr, SINGLE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                     PAGED: tl.constexpr = False, PAGE: tl.constexpr = 1, HAS_LIMITS: tl.constexpr = False):
    """One (query row, KV split, head block): online softmax over the split's slots, each latent / k_rope row
    read once for all heads. SINGLE (one split) writes the normalised output; otherwise the unnormalised
    accumulator and (running max, sum) go to the partial buffers for mla_decode_merge.

    PAGED: lat / kr are the cache pool's [pages, PAGE, width] and slot s of row b lives in page
    table[b, s // PAGE] at offset s % PAGE (strides b -> page, s -> offset in page). HAS_LIMITS: query t of row b
    sees slots < limit[b] + t (each row at its own position) instead of visible_before + t."""
    row = tl.program_id(0)  # b * length + t
    split = tl.program_id(1)
    b = (row // length).to(tl.int64)
    t = row % length
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    ranks = tl.arange(0, BLOCK_R)
    ropes = tl.arange(0, BLOCK_E)
    h_ok = heads < HEADS
    r_ok = ranks < RANK
    e_ok = ropes < ROPE
    q = tl.load(q_ptr + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + ranks[None, :] * stride_qr,
                mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    qr = tl.load(qr_ptr + b * stride_pb + t * stride_pt + heads[:, None] * stride_ph + ropes[None, :] * stride_pe,
                 mask=h_ok[:, None] & e_ok[None, :], other=0.0)
    if UPCAST:  # the CPU interpreter multiplies fp32 only
        q = q.to(tl.float32)
        qr = qr.to(tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    first = split * blocks_per_split * BLOCK_S
    blocks = blocks_per_split
    if not HAS_MASK:
        # A causal bound: blocks past the row's last visible slot are not visited (a pool row's table is padded
        # to the longest context, its unused splits cost one empty program).
        if HAS_LIMITS:
            visible_before = tl.load(limit_ptr + b * stride_limit).to(tl.int32)
        left = tl.minimum(total - first, visible_before + length - 1 - first)  # slots of this split still seen
        blocks = tl.minimum(blocks_per_split, tl.cdiv(tl.maximum(left, 0), BLOCK_S))
    # PAGED: each block's page numbers are loaded one block ahead, so the latent loads, which need them, do not
    # wait a memory round trip for them in every block (the loop then has no load that depends on another of
    # the same iteration, which is what lets the latent loads pipeline).
    slots = first + tl.arange(0, BLOCK_S)
    page_next = tl.zeros((BLOCK_S,), dtype=tl.int64)
    if PAGED:
        page_next = tl.load(table_ptr + b * stride_tb + (slots // PAGE) * stride_tp, mask=slots < total,
                            other=0).to(tl.int64)
    for i in range(0, blocks):
        slots = first + i * BLOCK_S + tl.arange(0, BLOCK_S)
        visible = slots < total
        if HAS_MASK:
            seen = tl.load(mask_ptr + b * stride_mb + t * stride_mt + slots * stride_ms, mask=visible, other=0)
            visible = visible & (seen != 0)
        else:
            visible = visible & (slots < visible_before + t)
        if PAGED:
            page = page_next
            ahead = slots + BLOCK_S
            page_next = tl.load(table_ptr + b * stride_tb + (ahead // PAGE) * stride_tp, mask=ahead < total,
                                other=0).to(tl.int64)
            lat_rows = page * stride_lb + (slots % PAGE) * stride_ls
            kr_rows = page * stride_kb + (slots % PAGE) * stride_ks
        else:
            lat_rows = b * stride_lb + slots * stride_ls
            kr_rows = b * stride_kb + slots * stride_ks
        # Masked lanes are not read: hidden slots (a static cache's unfilled capacity) cost no latent bytes.
        lat = tl.load(lat_ptr + lat_rows[:, None] + ranks[None, :] * stride_lr,
                      mask=visible[:, None] & r_ok[None, :], other=0.0)
        kr = tl.load(kr_ptr + kr_rows[:, None] + ropes[None, :] * stride_ke,
                     mask=visible[:, None] & e_ok[None, :], other=0.0)
        if UPCAST:
            lat = lat.to(tl.float32)
            kr = kr.to(tl.float32)
        if IEEE:  # fp32 inputs: no TF32 rounding, so a forced fp32 run matches the einsum twin
            scores = tl.dot(q, tl.trans(lat), input_precision="ieee")
            scores += tl.dot(qr, tl.trans(kr), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(lat)) + tl.dot(qr, tl.trans(kr))
        scores = tl.where(visible[None, :], scores * scale_log2, float("-inf"))  # base 2: exp2 below
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # While every slot so far is hidden the max is -inf; subtracting 0 instead keeps exp2 from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
        m_i = m_new
    hr_ok = h_ok[:, None] & r_ok[None, :]
    if SINGLE:
        # A row with no visible slot has l = 0 and acc = 0: 0 / 0 = NaN, as the einsum's softmax over all -inf.
        out = acc / tl.where(h_ok, l_i, 1.0)[:, None]  # padding heads divide by 1
        tl.store(out_ptr + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + ranks[None, :] * stride_or,
                 out.to(out_ptr.dtype.element_ty), mask=hr_ok)
    else:
        cell = row.to(tl.int64) * num_splits + split  # partials: [rows, splits, HEADS, RANK], [rows, splits, 2, HEADS]
        tl.store(part_ptr + cell * HEADS * RANK + heads[:, None] * RANK + ranks[None, :], acc, mask=hr_ok)
        tl.store(ml_ptr + cell * 2 * HEADS + heads, m_i, mask=h_ok)
        tl.store(ml_ptr + cell * 2 * HEADS + HEADS + heads, l_i, mask=h_ok)


@triton.jit
def mla_decode_merge(part_ptr, ml_ptr, out_ptr, stride_ob, stride_oh, stride_ot, stride_or, length, num_splits,
                     HEADS: tl.constexpr, RANK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """One (query row, head block): the splits' partial results joined by log-sum-exp (base 2)."""
    row = tl.program_id(0)
    b = (row // length).to(tl.int64)
    t = row % length
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ranks = tl.arange(0, BLOCK_R)
    h_ok = heads < HEADS
    hr_ok = h_ok[:, None] & (ranks < RANK)[None, :]
    cells = row.to(tl.int64) * num_splits
    m_all = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        m_all = tl.maximum(m_all, tl.load(ml_ptr + (cells + s) * 2 * HEADS + heads, mask=h_ok, other=0.0))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)  # a split with no visible slot has m = -inf, l = 0
    l_all = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for s in range(0, num_splits):
        m_s = tl.load(ml_ptr + (cells + s) * 2 * HEADS + heads, mask=h_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + (cells + s) * 2 * HEADS + HEADS + heads, mask=h_ok, other=0.0)
        weight = tl.exp2(m_s - m_safe)
        l_all += l_s * weight
        part = tl.load(part_ptr + (cells + s) * HEADS * RANK + heads[:, None] * RANK + ranks[None, :],
                       mask=hr_ok, other=0.0)
        acc += part * weight[:, None]
    # No visible slot in any split: 0 / 0 = NaN, as in the einsum path. Padding heads divide by 1.
    out = acc / tl.where(h_ok, l_all, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + ranks[None, :] * stride_or,
             out.to(out_ptr.dtype.element_ty), mask=hr_ok)
