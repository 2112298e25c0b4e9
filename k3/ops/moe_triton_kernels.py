"""The Triton kernels behind k3.ops.moe_triton and k3.ops.route_triton (see there); a module of its own because
it imports triton."""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting

# Whether this import decorated the kernels for Triton's CPU interpreter (the launchers reload on a change).
INTERPRETED = triton_interpreting()


@triton.jit
def _glu_rows(x_ptr, x_rows, row_ok, stride_xn, stride_xd, w_rows, w3_rows, stride_wd, stride_3d, col_ok,
              beta_gate, beta_up, in_width: tl.constexpr, GLU: tl.constexpr, SITU: tl.constexpr,
              UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: rows x_rows of x times one expert's weight tile (w_rows: pointers to its output
    columns), and with GLU the activation of (x W^T, x W3^T)."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_width, BLOCK_K):
        k_ok = (k0 + ks) < in_width
        x = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * stride_xn + (k0 + ks)[None, :] * stride_xd,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k0 + ks)[None, :] * stride_wd, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter multiplies fp32 only
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
        if GLU:
            w3 = tl.load(w3_rows + (k0 + ks)[None, :] * stride_3d, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
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
    return acc


@triton.jit
def expert_matmul(x_ptr, w_ptr, w3_ptr, out_ptr, counts_ptr,
                  stride_xn, stride_xd, stride_we, stride_wo, stride_wd, stride_3e, stride_3o, stride_3d,
                  stride_on, stride_oo, beta_gate, beta_up, out_width: tl.constexpr, in_width: tl.constexpr,
                  NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                  GLU: tl.constexpr, SITU: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows sorted by expert: expert e owns counts[e] rows after those of experts 0..e-1."""
    expert = tl.program_id(0)
    # The expert's rows start after every earlier expert's: a prefix sum over the counts, here rather than in a
    # cumsum kernel of its own (two fewer launches per MoE layer in a decode step that is launch-bound).
    others = tl.arange(0, EXPERTS_POW2)
    counts = tl.load(counts_ptr + others, mask=others < NUM_EXPERTS, other=0).to(tl.int32)
    start = tl.sum(tl.where(others < expert, counts, 0), axis=0)
    end = start + tl.load(counts_ptr + expert).to(tl.int32)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_width
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wo
    w3_rows = w3_ptr + expert.to(tl.int64) * stride_3e + cols[:, None] * stride_3o
    # A while loop, not range(start, end): Triton's CPU interpreter cannot take loaded loop bounds.
    row0 = start
    while row0 < end:  # no iteration for an expert with no rows: nothing is read
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        acc = _glu_rows(x_ptr, rows, row_ok, stride_xn, stride_xd, w_rows, w3_rows, stride_wd, stride_3d, col_ok,
                        beta_gate, beta_up, in_width, GLU, SITU, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :] * stride_oo,
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        row0 += BLOCK_M


@triton.jit
def _pairs_of_expert(ids_ptr, num_pairs, expert, first_rank, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """One pass over the routed ids: the pairs of `expert` whose rank among its pairs (in pair order) is
    first_rank .. first_rank + BLOCK_M - 1, as [BLOCK_M] int32 (0 past its last), and its number of pairs."""
    ps = tl.arange(0, BLOCK_P)
    ranks = first_rank + tl.arange(0, BLOCK_M)
    pairs = tl.zeros((BLOCK_M,), dtype=tl.int32)
    count = 0  # this expert's pairs in the chunks scanned so far
    for p0 in range(0, num_pairs, BLOCK_P):
        ids = tl.load(ids_ptr + p0 + ps, mask=p0 + ps < num_pairs, other=-1)
        mine = (ids == expert).to(tl.int32)
        rank = count + tl.cumsum(mine, axis=0) - 1
        picked = (mine[None, :] == 1) & (rank[None, :] == ranks[:, None])  # [BLOCK_M, BLOCK_P]
        pairs += tl.sum(tl.where(picked, p0 + ps[None, :], 0), axis=1)
        count += tl.sum(mine, axis=0)
    return pairs, count


@triton.jit
def expert_matmul_by_ids(x_ptr, w_ptr, w3_ptr, out_ptr, ids_ptr, num_pairs, lists_ptr, counts_ptr,
                         stride_xn, stride_xd, stride_we, stride_wo, stride_wd, stride_3e, stride_3o, stride_3d,
                         stride_on, stride_oo, beta_gate, beta_up, out_width: tl.constexpr, in_width: tl.constexpr,
                         PAIRS_PER_ROW: tl.constexpr, GLU: tl.constexpr, SITU: tl.constexpr, UPCAST: tl.constexpr,
                         LISTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_P: tl.constexpr):
    """Rows in pair order, no sort: pair p = t * top_k + k was routed to expert ids[p]; it reads x row
    p // PAIRS_PER_ROW (top_k for the token rows of the first projection, 1 for rows already in pair order) and
    writes out row p. Each program finds its expert's pairs itself: one pass over ids ranks them (a running
    cumulative sum), counts them and picks the first BLOCK_M, in pair order; an expert with more pairs takes one
    more pass per further block. That replaces the sort, its inverse, the count and two row permutations (six
    launches per MoE layer) with a scan of N small integers per program. (A separate counting pass before the
    first block, as this kernel first had, put one more round of dependent loads before any weight was read.)

    LISTS 0: scan. 1: scan, and the programs of the first column block also store their expert's pairs in
    lists[expert, :count] and the count in counts[expert]. 2: no scan: load those (what the first projection
    stored for the second, launched after it on the same stream)."""
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_width
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wo
    w3_rows = w3_ptr + expert.to(tl.int64) * stride_3e + cols[:, None] * stride_3o
    ranks = tl.arange(0, BLOCK_M)
    my_list = lists_ptr + expert.to(tl.int64) * num_pairs
    if LISTS == 2:
        count = tl.load(counts_ptr + expert)
        pairs = tl.load(my_list + ranks, mask=ranks < count, other=0)
    else:
        pairs, count = _pairs_of_expert(ids_ptr, num_pairs, expert, 0, BLOCK_M, BLOCK_P)
        if LISTS == 1:  # compile-time: with LISTS 0 no store nor test is in the kernel
            if tl.program_id(1) == 0:
                tl.store(counts_ptr + expert, count)
    row0 = 0
    while row0 < count:  # no iteration for an expert with no pairs: none of its weights is read
        if row0 > 0:
            if LISTS == 2:
                pairs = tl.load(my_list + row0 + ranks, mask=row0 + ranks < count, other=0)
            else:
                pairs, count = _pairs_of_expert(ids_ptr, num_pairs, expert, row0, BLOCK_M, BLOCK_P)
        row_ok = row0 + ranks < count
        if LISTS == 1:
            if tl.program_id(1) == 0:
                tl.store(my_list + row0 + ranks, pairs, mask=row_ok)
        acc = _glu_rows(x_ptr, pairs // PAIRS_PER_ROW, row_ok, stride_xn, stride_xd, w_rows, w3_rows, stride_wd,
                        stride_3d, col_ok, beta_gate, beta_up, in_width, GLU, SITU, UPCAST, BLOCK_M, BLOCK_N,
                        BLOCK_K)
        tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_on + cols[None, :] * stride_oo,
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        row0 += BLOCK_M


@triton.jit
def route_topk(logits_ptr, bias_ptr, ids_ptr, weights_ptr, scores_ptr, num_tokens, stride_lt, stride_le, scale,
               NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
               RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    """The sigmoid router after its GEMM, for a block of tokens in one program: scores = sigmoid(logits), top-k
    of scores + bias by k rounds of argmax (lowest expert id on a tie), gate weights = the chosen unbiased scores,
    renormalised and scaled. Writes ids [T, K] (int64, in descending biased score as torch.topk orders them),
    weights [T, K] fp32 and scores [T, E] fp32."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    experts = tl.arange(0, EXPERTS_POW2)
    e_ok = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + tokens[:, None].to(tl.int64) * stride_lt + experts[None, :] * stride_le,
                     mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + experts, mask=e_ok, other=0.0).to(tl.float32)
    biased = tl.where(e_ok[None, :], scores + bias[None, :], float("-inf"))
    slots = tl.arange(0, K_POW2)
    ids = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
    weights = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(biased, axis=1)
        pick = tl.min(tl.where(biased == best[:, None], experts[None, :], EXPERTS_POW2), axis=1)
        # A NaN score matches nothing: name expert 0 (its weight, the NaN, still poisons the output) rather than
        # an id past the experts, which the expert kernels would skip and leave the row unwritten.
        pick = tl.where(pick < NUM_EXPERTS, pick, 0)
        hit = experts[None, :] == pick[:, None]
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        weights = tl.where(slots[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], weights)
        biased = tl.where(hit, float("-inf"), biased)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scale
    k_ok = t_ok[:, None] & (slots[None, :] < TOP_K)
    pair = tokens[:, None].to(tl.int64) * TOP_K + slots[None, :]
    tl.store(ids_ptr + pair, ids.to(tl.int64), mask=k_ok)
    tl.store(weights_ptr + pair, weights, mask=k_ok)
    tl.store(scores_ptr + tokens[:, None].to(tl.int64) * NUM_EXPERTS + experts[None, :], scores,
             mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def combine_pairs_fwd(y_ptr, w_ptr, out_ptr, num_tokens, width, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_L: tl.constexpr):
    """out[t, :] = sum_k w[t, k] * y[t, k, :] for a [BLOCK_T, BLOCK_L] tile, fp32 accumulation. y [T, K, L] and
    w [T, K] contiguous; out [T, L] in y's dtype."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    t_ok = tokens < num_tokens
    ok = t_ok[:, None] & (cols < width)[None, :]
    rows = tokens.to(tl.int64) * TOP_K
    acc = tl.zeros((BLOCK_T, BLOCK_L), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        w = tl.load(w_ptr + rows + k, mask=t_ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + (rows + k)[:, None] * width + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += w[:, None] * y
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * width + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def combine_pairs_bwd(y_ptr, w_ptr, g_ptr, dy_ptr, dw_ptr, num_tokens, width, TOP_K: tl.constexpr,
                      K_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    """The backward of combine_pairs_fwd for BLOCK_T tokens over the whole width: dy[t, k, :] = w[t, k] g[t, :]
    (in y's dtype) and dw[t, k] = g[t, :] . y[t, k, :] (fp32 sums, stored in w's dtype). A program owns its
    tokens' every column, so dw needs no reduction across programs."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    slots = tl.arange(0, K_POW2)
    rows = tokens.to(tl.int64) * TOP_K
    k_ok = t_ok[:, None] & (slots < TOP_K)[None, :]
    w_all = tl.load(w_ptr + rows[:, None] + slots[None, :], mask=k_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    for l0 in range(0, width, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        ok = t_ok[:, None] & (cols < width)[None, :]
        g = tl.load(g_ptr + tokens[:, None].to(tl.int64) * width + cols[None, :], mask=ok, other=0.0)
        g = g.to(tl.float32)
        for k in tl.static_range(TOP_K):
            at_k = slots[None, :] == k
            w = tl.sum(tl.where(at_k, w_all, 0.0), axis=1)
            offsets = (rows + k)[:, None] * width + cols[None, :]
            y = tl.load(y_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            dw = tl.where(at_k, dw + tl.sum(g * y, axis=1)[:, None], dw)
            tl.store(dy_ptr + offsets, (w[:, None] * g).to(dy_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_ptr + rows[:, None] + slots[None, :], dw.to(dw_ptr.dtype.element_ty), mask=k_ok)
