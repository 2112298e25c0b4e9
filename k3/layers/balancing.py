"""Expert balancing: Quantile Balancing (K3) and the loss-free sign update (DeepSeek-V3 baseline).

Both act only on the router's selection bias b [E] (never on the gate weights), and only in training;
at eval time the bias is frozen and routing is plain top-k on s + b.

Quantile Balancing treats routing as a linear program (each token picks k experts, each expert receives
exactly q = k*T/E tokens) whose dual variables are the biases. Per step:
  biased = s + b; c_t = the (k+1)-th largest biased score of token t (its cutoff);
  r_te = c_t - s_te, the bias expert e needs to win token t;
  b_e  = the q-th smallest r_te over the batch, then b is mean-centred.
Expert e then receives token t iff s_te + b_e > c_t. Iterating the update on one batch reaches the
fixed point at which every expert gets exactly q tokens (ties aside).

Shape suffixes: T tokens, E experts, K top-k.
"""

from __future__ import annotations

from typing import Callable

import torch


# How QB pools its statistics over data-parallel ranks: the exact [T, E] gather or histograms (k3.distributed).
QB_AGGREGATES = ("gather", "histogram")


def expert_load(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert [E] (float) from the chosen ids."""
    return torch.bincount(topk_ids_TK.reshape(-1), minlength=num_experts).float()


def maxvio(load_E: torch.Tensor) -> float:
    """max_e(load_e / mean_load) - 1: 0 is perfect balance."""
    mean = load_E.float().mean()
    return float(load_E.max() / mean - 1) if mean > 0 else 0.0


def quantile_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                  gather: Callable[[torch.Tensor], torch.Tensor] | None = None, center: bool = True) -> torch.Tensor:
    """One Quantile Balancing update; returns the new bias [E] (fp32), mean-centred unless center=False
    (centring changes no top-k choice; the raw quantiles are what the cutoff rule compares against).

    `gather`, when given, concatenates the required-bias matrix over data-parallel ranks along T
    (exact aggregation), so every rank computes the same bias."""
    scores = scores_TE.float()
    num_tokens, num_experts = scores.shape
    if top_k >= num_experts:
        return torch.zeros_like(bias_E, dtype=torch.float32)
    biased = scores + bias_E.float()
    cutoff_T = biased.topk(top_k + 1, dim=-1).values[:, -1]
    required_TE = cutoff_T[:, None] - scores
    if gather is not None:
        required_TE = gather(required_TE)
        num_tokens = required_TE.shape[0]
    quota = top_k * num_tokens / num_experts
    # Bias between the q-th and (q+1)-th smallest required bias: exactly q tokens satisfy r < b.
    q = max(1, min(num_tokens, int(round(quota))))
    sorted_TE = required_TE.sort(dim=0).values
    upper = sorted_TE[min(q, num_tokens - 1)] if q < num_tokens else sorted_TE[-1] + 1.0
    new_bias = 0.5 * (sorted_TE[q - 1] + upper)
    return new_bias - new_bias.mean() if center else new_bias


def required_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """r_te = c_t - s_te, with c_t the (k+1)-th largest biased score of token t: [T, E] fp32."""
    scores = scores_TE.float()
    cutoff_T = (scores + bias_E.float()).topk(top_k + 1, dim=-1).values[:, -1]
    return cutoff_T[:, None] - scores


def quantile_bias_histogram(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                            reduce: Callable[[torch.Tensor, str], torch.Tensor], bins: int = 256, rounds: int = 3,
                            center: bool = True) -> torch.Tensor:
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
    required_TE = required_bias(scores_TE, bias_E, top_k).double()
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


def balance_batch(scores_TE: torch.Tensor, top_k: int, max_iters: int = 200) -> torch.Tensor:
    """Iterate the QB update on one batch until top-k on s + b gives every expert the same load (the
    fixed point of the update is the LP optimum); returns the bias. Used for analysis and tests."""
    num_experts = scores_TE.shape[1]
    bias = torch.zeros(num_experts, dtype=torch.float32, device=scores_TE.device)
    for _ in range(max_iters):
        bias = quantile_bias(scores_TE, bias, top_k)
        load = expert_load((scores_TE.float() + bias).topk(top_k, dim=-1).indices, num_experts)
        if load.max() == load.min():
            break
    return bias


def loss_free_bias(load_E: torch.Tensor, bias_E: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek-V3: b_e += gamma * sign(mean_load - load_e)."""
    return bias_E + gamma * torch.sign(load_E.float().mean() - load_E.float())
