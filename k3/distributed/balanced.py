"""Balanced expert parallelism in MoonEP's spirit: every rank computes the same number of token-expert pairs
however skewed the routing is.

The plan is computed from the global per-expert counts (all-gathered, so identical on every rank):

    target_r  = total_pairs / R   (the first total % R ranks take one more)
    load_r    = pairs of the experts homed on rank r
    an overloaded rank keeps its experts and sheds its excess from its hottest experts first;
    the shed pairs fill the under-loaded ranks in ascending rank order, as replica pieces of those experts.

A replica piece of expert e on rank r means: e's weights are sent to r for this step (and its gradient
returned to e's home rank in backward), and r computes that piece of e's pairs. Pieces of one expert are
ordered by rank; each rank holds at most one piece of an expert. With equal local batches the counts are
exactly equal (max/mean = 1.0).

Also here: `skewed_routing`, a context manager that skews routers on purpose (tests, benchmarks).

Shape suffixes: R ranks, E experts.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from k3.distributed.dispatcher import ExpertPlan


def balanced_plan(counts_RE: torch.Tensor) -> ExpertPlan:
    """counts_RE [R, E] pairs each rank routes to each expert -> a plan giving every rank the same pair count."""
    num_ranks, num_experts = counts_RE.shape
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {num_ranks} EP ranks; "
                         "choose an EP size that divides the expert count")
    experts_per_rank = num_experts // num_ranks
    per_expert = counts_RE.sum(0).tolist()
    total = sum(per_expert)
    target = [total // num_ranks + (1 if r < total % num_ranks else 0) for r in range(num_ranks)]
    load = [sum(per_expert[r * experts_per_rank:(r + 1) * experts_per_rank]) for r in range(num_ranks)]

    kept = list(per_expert)
    shed: list[tuple[int, int]] = []  # (expert, pairs moved off its home rank), in placement order
    for rank in range(num_ranks):
        excess = load[rank] - target[rank]
        homed = range(rank * experts_per_rank, (rank + 1) * experts_per_rank)
        for expert in sorted(homed, key=lambda e: (-per_expert[e], e)):
            if excess <= 0:
                break
            take = min(excess, per_expert[expert])
            if take > 0:
                shed.append((expert, take))
                kept[expert] -= take
                excess -= take

    room = [max(0, target[r] - load[r]) for r in range(num_ranks)]
    placed: dict[tuple[int, int], int] = {}
    receiver = 0
    for expert, pairs in shed:
        while pairs > 0:
            while room[receiver] == 0:
                receiver += 1
            take = min(pairs, room[receiver])
            placed[(expert, receiver)] = placed.get((expert, receiver), 0) + take
            room[receiver] -= take
            pairs -= take

    pieces = [(e, e // experts_per_rank, kept[e]) for e in range(num_experts)]
    pieces += [(e, r, n) for (e, r), n in placed.items()]
    pieces.sort(key=lambda piece: (piece[0], piece[1]))
    return ExpertPlan(num_ranks, experts_per_rank, [p[0] for p in pieces], [p[1] for p in pieces],
                      [p[2] for p in pieces])


def imbalance(pairs_per_rank: list[int]) -> float:
    """max / mean of the pairs computed per rank: 1.0 is perfect balance."""
    mean = sum(pairs_per_rank) / len(pairs_per_rank)
    return max(pairs_per_rank) / mean if mean > 0 else 1.0


@contextlib.contextmanager
def skewed_routing(model: nn.Module, hot_experts: list[int], boost: float = 10.0) -> Iterator[None]:
    """Make every router prefer `hot_experts` by adding `boost` to their selection bias (restored on exit).

    With boost larger than the score range (sigmoid scores lie in (0, 1)) every token picks the hot experts
    first: a deliberately skewed router, the opposite of `Router.force_balanced`."""
    from k3.layers.moe import Router

    saved = []
    for module in model.modules():
        if isinstance(module, Router):
            saved.append((module, module.e_score_correction_bias.clone(), module.balancing))
            module.balancing = "none"  # QB would re-solve (and so undo) the skew inside a training forward
            with torch.no_grad():
                module.e_score_correction_bias[hot_experts] += boost
    try:
        yield
    finally:
        with torch.no_grad():
            for module, bias, balancing in saved:
                module.e_score_correction_bias.copy_(bias)
                module.balancing = balancing
