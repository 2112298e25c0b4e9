"""The Triton kernels behind k3.ops.qb_triton (see there); a module of its own because it imports triton."""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting

# Whether this import decorated the kernels for Triton's CPU interpreter (the launchers reload on a change).
INTERPRETED = triton_interpreting()

_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def topk_with_load(scores_ptr, bias_ptr, values_ptr, indices_ptr, load_ptr, num_rows, stride_st, stride_se, stride_b,
                   NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, TOP_K: tl.constexpr,
                   K_POW2: tl.constexpr, COUNTED: tl.constexpr, BLOCK_T: tl.constexpr):
    """Top-k of scores + bias for BLOCK_T rows by k rounds of argmax (lowest expert id on a tie), written as
    values [T, K] fp32 and indices [T, K] int64 in descending order; the rows' first COUNTED picks are added to
    load [E] fp32 (zeroed by the launcher) as one histogram per program."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < num_rows
    experts = tl.arange(0, EXPERTS_POW2)
    e_ok = experts < NUM_EXPERTS
    valid = r_ok[:, None] & e_ok[None, :]
    scores = tl.load(scores_ptr + rows[:, None].to(tl.int64) * stride_st + experts[None, :] * stride_se,
                     mask=valid, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + experts * stride_b, mask=e_ok, other=0.0).to(tl.float32)
    biased = scores + bias[None, :]  # one fp32 add, rounded as torch rounds it
    # Picks are struck from `free` rather than overwritten with -inf, so that a score of -inf is still picked
    # (lowest id first) instead of a pick being repeated.
    free = valid
    slots = tl.arange(0, K_POW2)
    values = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, biased, float("-inf")), axis=1)
        pick = tl.min(tl.where(free & (biased == best[:, None]), experts[None, :], EXPERTS_POW2), axis=1)
        # A NaN matches nothing: keep the id in range (the callers index with it) rather than past the experts.
        pick = tl.where(pick < NUM_EXPERTS, pick, 0)
        values = tl.where(slots[None, :] == j, best[:, None], values)
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        free = free & (experts[None, :] != pick[:, None])
        if j == COUNTED - 1:
            # Integer counts in fp32 are exact below 2^24 whatever order the programs add them in.
            load = tl.sum((valid & ~free).to(tl.int32), axis=0)
            tl.atomic_add(load_ptr + experts, load.to(tl.float32), mask=e_ok & (load > 0), sem="relaxed")
    k_ok = r_ok[:, None] & (slots[None, :] < TOP_K)
    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    tl.store(values_ptr + out, values, mask=k_ok)
    tl.store(indices_ptr + out, ids.to(tl.int64), mask=k_ok)


@triton.jit
def _order_key(x):
    """fp32 -> int32 with the same order (as signed integers): negative floats have their magnitude bits
    flipped. -0.0 is taken as +0.0 first, since torch compares them equal."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return bits ^ ((bits >> 31) & _INT32_MAX)


@triton.jit
def _key_value(key):
    """The inverse of _order_key (the map is its own inverse)."""
    return (key ^ ((key >> 31) & _INT32_MAX)).to(tl.float32, bitcast=True)


@triton.jit
def _select_digit(hist, rank):
    """The digit whose bin holds the rank-th smallest (1-based) of the counted keys, and that key's rank among
    the keys of its bin."""
    bins = tl.arange(0, 256)
    digit = tl.sum((tl.cumsum(hist, axis=0) < rank).to(tl.int32), axis=0)
    return digit, rank - tl.sum(tl.where(bins < digit, hist, 0), axis=0)


@triton.jit
def _replayed(hist_ptr, expert, num_experts, num_slices, q, PASSES: tl.constexpr, SLICES_POW2: tl.constexpr):
    """The digits chosen by the first PASSES passes, from their per-slice histograms hist [4, E, S, 256]: the
    selected key's prefix (key >> (32 - 8 * PASSES), signed) and its rank among the keys with that prefix."""
    bins = tl.arange(0, 256)
    slices = tl.arange(0, SLICES_POW2)
    prefix = tl.full((), 0, tl.int32)
    rank = q
    for j in tl.static_range(PASSES):
        rows = (j * num_experts + expert) * num_slices + slices
        hist = tl.sum(tl.load(hist_ptr + rows[:, None] * 256 + bins[None, :], mask=(slices < num_slices)[:, None],
                              other=0), axis=0)
        digit, rank = _select_digit(hist, rank)
        if j == 0:
            prefix = digit - 128  # key >> 24 of the q-th, as a signed (arithmetic) shift gives it
        else:
            prefix = prefix * 256 + digit
    return prefix, rank


@triton.jit
def kth_radix_pass(x_ptr, keys_ptr, hist_ptr, least_ptr, num_rows, num_experts, num_slices, chunk, stride_xt,
                   stride_xe, q, PASS: tl.constexpr, SLICES_POW2: tl.constexpr, BLOCK_T: tl.constexpr):
    """Pass PASS (0-3) of the radix select for column e = program_id(0), over its rows slice * chunk onwards
    (slice = program_id(1)): the 256-bin histogram of digit PASS (bits 31-24 first) of the keys whose higher
    digits match the ones chosen so far (replayed from the earlier passes' histograms), into hist[PASS, e, slice].
    Pass 0 reads the column through its strides and stores its keys in keys[e] [T] int32, which the later
    passes read contiguously; pass 3 also writes the least key above the 24-bit prefix to least[e, slice]."""
    expert = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    prefix, _ = _replayed(hist_ptr, expert, num_experts, num_slices, q, PASS, SLICES_POW2)
    offs = tl.arange(0, BLOCK_T)
    keys_row = keys_ptr + expert * num_rows
    end = tl.minimum(num_rows, (piece + 1) * chunk)
    shift: tl.constexpr = 24 - 8 * PASS
    hist = tl.zeros((256,), dtype=tl.int32)
    least_above = tl.full((), _INT32_MAX, tl.int32)
    for t0 in range(piece * chunk, end, BLOCK_T):
        t = t0 + offs
        ok = t < end
        if PASS == 0:
            key = _order_key(tl.load(x_ptr + expert * stride_xe + t.to(tl.int64) * stride_xt, mask=ok, other=0.0))
            tl.store(keys_row + t, key, mask=ok)
            hist += tl.histogram(((key >> 24) & 255) ^ 128, 256, mask=ok)  # the sign bit flipped: unsigned order
        else:
            key = tl.load(keys_row + t, mask=ok, other=0)
            hist += tl.histogram((key >> shift) & 255, 256, mask=ok & ((key >> (shift + 8)) == prefix))
            if PASS == 3:
                least_above = tl.minimum(least_above, tl.min(tl.where(ok & ((key >> 8) > prefix), key, _INT32_MAX),
                                                             axis=0))
    row = (PASS * num_experts + expert) * num_slices + piece
    tl.store(hist_ptr + row * 256 + tl.arange(0, 256), hist)
    if PASS == 3:
        tl.store(least_ptr + expert * num_slices + piece, least_above)


@triton.jit
def kth_finish(hist_ptr, least_ptr, qth_ptr, upper_ptr, num_experts, num_slices, q, SLICES_POW2: tl.constexpr):
    """For column e = program_id: qth[e] = its q-th smallest value (1-based), upper[e] = the smallest value above
    that, or qth + 1.0 when there is none but +inf. The last digit comes from pass 3's histograms; the next larger
    key lies in a later bin of that digit, or else it is the least key above the 24-bit prefix."""
    expert = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, 256)
    slices = tl.arange(0, SLICES_POW2)
    prefix, rank = _replayed(hist_ptr, expert, num_experts, num_slices, q, 3, SLICES_POW2)
    rows = (3 * num_experts + expert) * num_slices + slices
    in_range = slices < num_slices
    hist = tl.sum(tl.load(hist_ptr + rows[:, None] * 256 + bins[None, :], mask=in_range[:, None], other=0), axis=0)
    least_above = tl.min(tl.load(least_ptr + expert * num_slices + slices, mask=in_range, other=_INT32_MAX), axis=0)
    digit, rank = _select_digit(hist, rank)
    next_digit = tl.min(tl.where((bins > digit) & (hist > 0), bins, 256), axis=0)
    qth = _key_value(prefix * 256 + digit)
    upper_key = tl.where(next_digit < 256, prefix * 256 + next_digit, least_above)
    # _INT32_MAX is the key of one NaN pattern only; NaN input is not supported.
    found = (next_digit < 256) | (least_above != _INT32_MAX)
    upper = _key_value(upper_key)
    tl.store(qth_ptr + expert, qth)
    tl.store(upper_ptr + expert, tl.where(found & (upper != float("inf")), upper, qth + 1.0))
