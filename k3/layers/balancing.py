"""Expert balancing: Quantile Balancing (K3) and the loss-free sign update (DeepSeek-V3 baseline).

Both act only on the router's selection bias b [E] (never on the gate weights), and only in training;
at eval time the bias is frozen and routing is plain top-k on s + b.

Quantile Balancing treats routing as a linear program (each token picks k experts, each expert receives
exactly q = k*T/E tokens) whose dual variables are the biases. Per step:
  biased = s + b; c_t = the (k+1)-th largest biased score of token t (its cutoff);
  r_te = c_t - s_te, the bias expert e needs to win token t;
  b_e  = the q-th smallest r_te over the batch, then b is mean-centred.
Expert e then receives token t iff s_te + b_e > c_t, given the other experts' biases. All biases move at
once, so the cutoffs move too and one update does not balance the batch (measured in the tiny preset's
training: maxvio 0.56 mean, 2.6 p99 after one update; the bias solved on the previous batch gives 4-7).

Two rules use it in training (Router.qb_max_iters picks):
- published (0, the default): ONE update per MoE layer and step from the current batch's scores and the bias
  it was routed with (published_bias), applied from the next step on; no host sync, one top-(k+1) that also
  gives the selection, and one k/E quantile per expert. Over data-parallel ranks the quantile comes from
  all-reduced [E, 1000] histograms over [min(b) - 1, max(b) + 1] (published_bias_histogram).
- iterated (N > 0, research): the update iterated on the batch being routed (solve_batch_bias) until top-k on
  s + b gives every expert its quota, the fixed point (the LP optimum, ties aside), or N updates; its stopping
  test reads the device from the host.

Shape suffixes: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from k3.ops.qb_triton import expert_load, kth_smallest_and_next, topk_with_load


# How QB pools its statistics over data-parallel ranks: the exact [T, E] gather or histograms (k3.distributed).
QB_AGGREGATES = ("gather", "histogram")


def maxvio(load_E: torch.Tensor) -> float:
    """max_e(load_e / mean_load) - 1: 0 is perfect balance."""
    mean = load_E.float().mean()
    return float(load_E.max() / mean - 1) if mean > 0 else 0.0


def required_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, of_others: bool = False,
                  top=None) -> torch.Tensor:
    """r_te = c_te - s_te, the bias expert e needs to win token t: [T, E] fp32. `top`: the (values, indices) of
    (scores + bias).topk(top_k + 1) when the caller already has them.

    SPEC section 7 takes c_te = c_t, the (k+1)-th largest biased score of token t, for every expert. That is
    exact for the experts t chose (to stay, e must beat the best of the rest, the (k+1)-th); an expert t did
    not choose must beat the k-th. `of_others=True` uses the k-th largest biased score of the OTHER experts
    for each (t, e), so that "e receives t iff s_te + b_e > c_te" holds for every pair given the other
    biases. Both rules have the same fixed point (a balanced batch); measured on the tiny preset's router
    scores the exact cutoffs reach it in fewer iterations (after 32: maxvio mean 0.007 vs 0.016, p99 0.023
    vs 0.070) and the SPEC rule alone can stall with one expert 7 tokens short of its 128."""
    scores = scores_TE.float()
    if top is None:
        top = (scores + bias_E.float()).topk(top_k + 1, dim=-1)
    cutoff_TE = top.values[:, -1:].expand_as(scores)
    if of_others:
        chosen_TE = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top.indices[:, :top_k], True)
        cutoff_TE = torch.where(chosen_TE, cutoff_TE, top.values[:, top_k - 1:top_k])
        return cutoff_TE - scores
    # The (k+1)-th expert's own r is its bias exactly; (s + b) - s would round it by the last bits of s, which
    # differ between batch layouts, and decide whether the k/E quantile sees a tie there (a jump of half a gap).
    runner_up_T1 = top.indices[:, top_k:top_k + 1]
    return (cutoff_TE - scores).scatter_(1, runner_up_T1, bias_E.float()[runner_up_T1])


def quantile_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                  gather: Callable[[torch.Tensor], torch.Tensor] | None = None, center: bool = True,
                  of_others: bool = False, top=None) -> torch.Tensor:
    """One Quantile Balancing update; returns the new bias [E] (fp32), mean-centred unless center=False
    (centring changes no top-k choice; the raw quantiles are what the cutoff rule compares against).
    `of_others`: the cutoff rule of required_bias.

    `gather`, when given, concatenates the required-bias matrix over data-parallel ranks along T
    (exact aggregation), so every rank computes the same bias."""
    num_tokens, num_experts = scores_TE.shape
    if top_k >= num_experts:
        return torch.zeros_like(bias_E, dtype=torch.float32)
    required_TE = required_bias(scores_TE, bias_E, top_k, of_others, top)
    if gather is not None:
        required_TE = gather(required_TE)
        num_tokens = required_TE.shape[0]
    quota = top_k * num_tokens / num_experts
    # Bias between the q-th and (q+1)-th smallest required bias: exactly q tokens satisfy r < b.
    q = max(1, min(num_tokens, int(round(quota))))
    # The bias goes between the q-th and the next larger value (ties with the q-th count as the q-th).
    qth_E, upper_E = kth_smallest_and_next(required_TE, q)
    new_bias = 0.5 * (qth_E + upper_E)
    return new_bias - new_bias.mean() if center else new_bias


def quantile_bias_histogram(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                            reduce: Callable[[torch.Tensor, str], torch.Tensor], bins: int = 256, rounds: int = 3,
                            center: bool = True, of_others: bool = False, top=None) -> torch.Tensor:
    """Quantile Balancing aggregated over data-parallel ranks by histograms instead of gathering [T, E].

    `reduce(tensor, op)` all-reduces in place and returns it, op in {"sum", "min", "max"} (identity on one
    rank). Each round all-reduces an [E, bins] count matrix and narrows every expert's window to the bin that
    holds its q-th smallest required bias, so after `rounds` rounds the bias is placed to within
    range / bins**rounds: the exact quantile up to that resolution, for E*bins numbers per round whatever the
    number of ranks or tokens."""
    num_experts = scores_TE.shape[1]
    if top_k >= num_experts:
        return torch.zeros_like(bias_E, dtype=torch.float32)
    # float64 so that a value's bin and the window edges derived from it agree on every rank
    required_TE = required_bias(scores_TE, bias_E, top_k, of_others, top).double()
    total = reduce(torch.tensor([float(required_TE.shape[0])], dtype=torch.float64, device=required_TE.device), "sum")
    num_tokens = int(total.item())
    q = max(1, min(num_tokens, int(round(top_k * num_tokens / num_experts))))
    lo_E = reduce(required_TE.min(0).values, "min")
    hi_E = reduce(required_TE.max(0).values, "max")
    below_E = torch.zeros(num_experts, dtype=torch.float64, device=required_TE.device)
    experts = torch.arange(num_experts, device=required_TE.device)
    for _ in range(rounds):
        width_E = ((hi_E - lo_E) / bins).clamp_min(1e-12)
        position = (required_TE - lo_E) / width_E
        inside = (position >= 0) & (required_TE <= hi_E)
        index = position.floor().clamp(0, bins - 1).long()
        counts_EB = torch.zeros(num_experts, bins, dtype=torch.float64, device=required_TE.device)
        counts_EB.index_put_((experts.expand_as(index)[inside], index[inside]),
                             torch.ones_like(required_TE)[inside], accumulate=True)
        counts_EB = reduce(counts_EB, "sum")
        cumulative_EB = below_E[:, None] + counts_EB.cumsum(dim=1)
        j_E = (cumulative_EB < q).sum(dim=1).clamp(max=bins - 1)  # first bin reaching q
        before_E = torch.where(j_E > 0, cumulative_EB.gather(1, (j_E - 1).clamp(min=0)[:, None]).squeeze(1),
                               below_E)
        below_E = before_E
        lo_E, hi_E = lo_E + j_E * width_E, lo_E + (j_E + 1) * width_E
    # The q-th smallest lies in [lo, hi]; the bias goes just above the window (rounded up to fp32, the
    # precision the required biases were computed in), so the q values at or below it satisfy r < b.
    new_bias = hi_E.float()
    new_bias = torch.where(new_bias.double() < hi_E, torch.nextafter(new_bias, torch.full_like(new_bias, float("inf"))),
                           new_bias)
    return new_bias - new_bias.mean() if center else new_bias


# Bins of the published rule's per-expert histogram over [min(b) - 1, max(b) + 1] (Megatron, TransformerEngine and
# torchtitan take 1000): the quantile is placed within (max(b) - min(b) + 2) / 1000 of the exact one.
QB_HISTOGRAM_BINS = 1000


def published_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, top=None,
                   gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Quantile Balancing as published (SPEC section 7): the bias [E] fp32 for the NEXT step, from this batch's
    scores [T, E] and the bias `bias_E` it was routed with. c_t = the (k+1)-th largest s_t + b;
    r_te = c_t - s_te; b_e = the k/E quantile of r_.e over the batch (between the q-th and (q+1)-th smallest,
    q = k*T/E); then b minus its mean. `top`: (scores + bias).topk(k + 1) when the caller has it (the routing's
    own selection). `gather`: exact pooling of r over data-parallel ranks. No host sync."""
    return quantile_bias(scores_TE, bias_E, top_k, gather=gather, center=True, of_others=False, top=top)


def published_bias_histogram(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                             reduce: Callable[[torch.Tensor, str], torch.Tensor], bins: int = QB_HISTOGRAM_BINS,
                             top=None) -> torch.Tensor:
    """published_bias with r pooled over data-parallel ranks as per-expert histograms: one all-reduce of an
    [E, bins] count matrix over [min(b) - 1, max(b) + 1] (every r lies inside: c_t - s_te with scores in (0, 1)),
    the quantile placed by linear interpolation inside the bin that holds the q-th smallest, so within one bin
    width of the exact quantile. `reduce(tensor, "sum")` all-reduces in place (identity on one rank); the bias is
    the same on every rank, so is the range. No host sync: q is computed on the device from the pooled counts."""
    num_tokens, num_experts = scores_TE.shape
    if top_k >= num_experts:
        return torch.zeros_like(bias_E, dtype=torch.float32)
    required_TE = required_bias(scores_TE, bias_E, top_k, top=top)
    bias = bias_E.float()
    low, width = bias.min() - 1.0, (bias.max() - bias.min() + 2.0) / bins
    index_ET = ((required_TE.t() - low) / width).floor().clamp(0, bins - 1).long()
    counts_EB = torch.zeros(num_experts, bins, dtype=torch.float32, device=scores_TE.device)
    counts_EB.scatter_add_(1, index_ET, torch.ones_like(index_ET, dtype=torch.float32))
    counts_EB = reduce(counts_EB, "sum")
    cumulative_EB = counts_EB.cumsum(dim=1)
    total = cumulative_EB[0, -1]  # tokens over all ranks: every token is counted once per expert
    q = (top_k * total / num_experts).round().clamp(1, total)
    j_E = (cumulative_EB < q).sum(dim=1).clamp(max=bins - 1)  # the bin holding the q-th smallest
    before_E = torch.where(j_E > 0, cumulative_EB.gather(1, (j_E - 1).clamp(min=0)[:, None]).squeeze(1),
                           torch.zeros_like(q).expand(num_experts))
    inside_E = counts_EB.gather(1, j_E[:, None]).squeeze(1).clamp_min(1.0)
    new_bias = low + width * (j_E + (q - before_E) / inside_E)
    return new_bias - new_bias.mean()


# Router.qb_max_iters for the published rule (one update per step, applied at the next); N > 0 iterates instead.
QB_PUBLISHED = 0
# Cap on the QB updates per MoE layer and training step of the iterated rule (the research option, --qb-iters); the solver stops as soon as the batch is balanced.
# Measured on the tiny preset's router scores in training (1,024 tokens, 16 experts, top-2, 280 batches):
# one update leaves maxvio 0.56 mean / 2.6 p99; the solver balances 98% of the batches exactly after 18
# updates on average, the rest to within one token (maxvio 0.0078).
QB_MAX_ITERS = 64
# What the training forward accepts as balanced: every expert within 1% of its quota k*T/E (rounded outwards).
# Exact balance (tolerance 0) costs many more updates on large batches of near-tied scores: on one H200 at
# 16K tokens, 64 experts, top-6, the exact solve took ~45 updates per layer, 40% of the `small` training step.
QB_TOLERANCE = 0.01
# On a GPU the training forward's solver reads its stopping test on the host once per this many updates (see
# solve_batch_bias; same bias, same count). In `k3 train --preset small` on one H200 the solver took about 18
# updates per layer and step, each a host wait on the device: 1,130 host reads of device values per step.
QB_SYNC_EVERY = 4


def balanced_enough(load_E: torch.Tensor, top_k: int, num_tokens: int, tolerance: float = 0.0) -> bool:
    """True when every expert holds between min(floor(q), ceil(q (1 - tolerance))) and
    max(ceil(q), floor(q (1 + tolerance))) pairs, q = k*T/E: the tolerance rounded inwards, so a small quota
    stays exact (at q = 8, 1% is no token); tolerance 0 is the best any top-k routing can do."""
    return _inside_quota(*_load_bounds(load_E), top_k, num_tokens, load_E.numel(), tolerance)


def _load_bounds(load_E: torch.Tensor) -> tuple[float, float]:
    """(min, max) of the loads in one read back to the host (a sync on CUDA), not one per bound."""
    low, high = torch.stack(torch.aminmax(load_E)).tolist()
    return low, high


def _inside_quota(low: float, high: float, top_k: int, num_tokens: int, num_experts: int, tolerance: float) -> bool:
    quota = top_k * num_tokens / num_experts
    upper = max(math.ceil(quota), math.floor(quota * (1 + tolerance)))
    lower = min(math.floor(quota), math.ceil(quota * (1 - tolerance)))
    return high <= upper and low >= lower


def solve_batch_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, max_iters: int = QB_MAX_ITERS,
                     gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
                     tolerance: float = 0.0, sync_every: int = 1) -> tuple[torch.Tensor, int]:
    """The bias that balances this batch: the QB update (SPEC section 7, with the exact cutoffs of
    required_bias(of_others=True)) iterated from `bias_E` on the same scores [T, E] until top-k on s + b gives
    every expert its quota (within `tolerance`, see balanced_enough), or `max_iters` updates. Returns
    (bias [E] fp32 mean-centred, updates used: 0 when `bias_E` already balances the batch); when the cap is
    hit, the bias of the most balanced iterate.

    One top-(k+1) per update serves both the load test of the current bias and the next update's cutoffs.
    Over data-parallel ranks, `gather` (exact) or `reduce` (histograms) pool the statistics of every update
    and the loads of the stopping test, so every rank takes the same number of updates and the same bias.

    sync_every > 1 (one rank): the stopping test stays on the device and the host reads it once per
    `sync_every` updates (solve_batch_bias_on_device's bookkeeping), for the same bias and count: up to
    sync_every - 1 updates past the balanced one are computed and discarded, and the host waits on the device
    sync_every times less often (on a GPU each wait drains the queue the host would otherwise run ahead of)."""
    if sync_every > 1 and gather is None and reduce is None:
        bias, used = _solve_on_device(scores_TE, bias_E, top_k, max_iters, tolerance, sync_every)
        return bias, int(used)
    num_experts = scores_TE.shape[1]
    if top_k >= num_experts:
        return torch.zeros_like(bias_E, dtype=torch.float32), 0
    scores = scores_TE.float()
    num_tokens = scores.shape[0]
    if gather is not None:
        num_tokens = int(gather(torch.tensor([[float(num_tokens)]], device=scores.device)).sum())
    elif reduce is not None:
        num_tokens = int(reduce(torch.tensor([float(num_tokens)], device=scores.device), "sum").item())

    def routed(bias):
        if gather is None and reduce is None:
            top = topk_with_load(scores, bias, top_k + 1, top_k)
            return top, top.load_E
        top = (scores + bias).topk(top_k + 1, dim=-1)
        load_E = expert_load(top.indices[:, :top_k], num_experts)
        if gather is not None:
            load_E = gather(load_E[None]).sum(0)
        else:
            load_E = reduce(load_E, "sum")
        return top, load_E

    bias = bias_E.float()
    top, load_E = routed(bias)
    low, peak = _load_bounds(load_E)  # the solver's one sync per update
    if _inside_quota(low, peak, top_k, num_tokens, num_experts, tolerance):
        return bias - bias.mean(), 0
    best, best_peak = bias, peak
    for used in range(1, max_iters + 1):
        if reduce is not None:
            update = quantile_bias_histogram(scores, bias, top_k, reduce, of_others=True, top=top)
        else:
            update = quantile_bias(scores, bias, top_k, gather, of_others=True, top=top)
        # Full updates alone fall into 2-cycles in which a few tokens swap between two experts (the batch stays
        # 1-9 tokens off for 200 updates); a half step every other update breaks them.
        bias = update if used % 2 == 1 else 0.5 * (bias + update)
        top, load_E = routed(bias)
        low, peak = _load_bounds(load_E)
        if _inside_quota(low, peak, top_k, num_tokens, num_experts, tolerance):
            return bias, used
        if peak < best_peak:
            best, best_peak = bias, peak
    return best, max_iters


def solve_batch_bias_on_device(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, updates: int,
                               tolerance: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """solve_batch_bias with no host sync, so that a training step can be captured in a CUDA graph: exactly
    `updates` QB updates are computed, and the stopping test is kept on the device: the first balanced iterate is
    kept (later updates are computed and discarded), so the result equals solve_batch_bias's whenever that one
    stops within `updates`; otherwise it is the most balanced iterate, as solve_batch_bias's is at its cap. Returns (bias [E] fp32, updates used as a 0-dim int64 tensor: `updates` when not balanced).
    One rank only: the gathered and histogram aggregations over ranks need the host-side solver."""
    return _solve_on_device(scores_TE, bias_E, top_k, updates, tolerance, sync_every=None)


def _solve_on_device(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, updates: int, tolerance: float,
                     sync_every: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The device-side solver; with `sync_every`, the host reads the stopping test before the first update and
    after every `sync_every` updates and stops once the batch is balanced (the result is the same)."""
    num_tokens, num_experts = scores_TE.shape
    if top_k >= num_experts:
        return torch.zeros_like(bias_E, dtype=torch.float32), torch.zeros((), dtype=torch.long,
                                                                          device=scores_TE.device)
    scores = scores_TE.float()
    quota = top_k * num_tokens / num_experts
    upper = max(math.ceil(quota), math.floor(quota * (1 + tolerance)))
    lower = min(math.floor(quota), math.ceil(quota * (1 - tolerance)))

    def routed(bias):
        top = topk_with_load(scores, bias, top_k + 1, top_k)
        low, peak = torch.aminmax(top.load_E)
        return top, (peak <= upper) & (low >= lower), peak

    bias = bias_E.float()
    top, done, peak = routed(bias)
    result = bias - bias.mean()
    used = torch.zeros((), dtype=torch.long, device=scores.device)
    best, best_peak = bias, peak
    if sync_every is not None and bool(done):
        return result, used
    for step in range(1, updates + 1):
        update = quantile_bias(scores, bias, top_k, of_others=True, top=top)
        candidate = update if step % 2 == 1 else 0.5 * (bias + update)  # the half steps of solve_batch_bias
        bias = candidate
        top, balanced, peak = routed(bias)
        # On bools a > b is a & ~b: fewer small ops per update (the eager trainer launches each of them).
        newly = balanced > done
        settled = done | balanced
        better = (peak < best_peak) > settled
        result = torch.where(newly, bias, result)
        used = torch.where(newly, step, used)
        best = torch.where(better, bias, best)
        best_peak = torch.where(better, peak, best_peak)
        done = settled
        if sync_every is not None and step % sync_every == 0 and step < updates and bool(done):
            break
    return torch.where(done, result, best), torch.where(done, used, updates)


def balance_batch(scores_TE: torch.Tensor, top_k: int, max_iters: int = 200) -> torch.Tensor:
    """The bias that balances one batch, solved from zero (see solve_batch_bias). For analysis and tests."""
    zeros = torch.zeros(scores_TE.shape[1], dtype=torch.float32, device=scores_TE.device)
    return solve_batch_bias(scores_TE, zeros, top_k, max_iters)[0]


def loss_free_bias(load_E: torch.Tensor, bias_E: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek-V3: b_e += gamma * sign(mean_load - load_e)."""
    return bias_E + gamma * torch.sign(load_E.float().mean() - load_E.float())
