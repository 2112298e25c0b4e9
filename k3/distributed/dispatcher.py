"""Expert-parallel dispatch and combine over `all_to_all_single`.

Each EP rank owns a contiguous block of experts (its "home" experts). One MoE step:

    1. counts: every rank all-gathers the per-expert pair counts of every rank -> C [R, E]
    2. plan:   an `ExpertPlan` (identical on every rank, computed from C) says which rank computes which
               pairs of which expert: the plain plan keeps every expert at home; the balanced plan
               (balanced.py) also places pieces of hot experts on under-loaded ranks
    3. dispatch: pairs are permuted by (destination rank, expert) and the LATENT vectors are sent with
               `all_to_all_single` and split sizes (K3 sends the latent, half the bytes of the hidden state)
    4. experts: the receiver reorders pairs from (source, slot) to (slot, source) and runs its slots
               grouped (`k3.ops.moe.run_experts`): one grouped GEMM over its home experts and, in balanced
               mode, one over the replicas placed here (two weight groups, so no weight stack is copied)
    5. combine: the outputs travel back by the reverse all_to_all and are un-permuted to [T, K, L];
               the caller sums over K in a fixed order (no atomics anywhere: deterministic)

Replica weights (balanced plan) travel by a second all_to_all whose backward returns the replicas'
gradients to the home rank, where autograd adds them to the home expert's gradient.

Split sizes must be Python ints for `all_to_all_single`, so each MoE layer syncs the host once (after the
count all-gather); the plan, the split sizes and the per-(source, slot) segment table are derived on the host
from the counts (O(R * E) numbers); the per-pair permutations are built on the tokens' device from them.

Shape suffixes: T local tokens, K top-k, N = T*K local pairs, L expert input width (latent), F expert
width, E experts, R EP ranks, P pieces of the plan, S slots (experts computed on this rank), M pairs
received by this rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3.ops.moe import inverse_permutation, run_experts


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` along dim 0 whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        output_splits, input_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(input_splits),) + tuple(grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None) -> torch.Tensor:
    """Differentiable `all_to_all_single` along dim 0: x [sum(input_splits), ...] -> [sum(output_splits), ...]."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


@dataclass
class ExpertPlan:
    """Where the pairs of every expert are computed for one step; identical on every rank.

    The pairs of expert e, ordered by (source rank, position in the source's expert-sorted list), are cut
    into consecutive pieces; piece p (sorted by expert, then by rank) takes `piece_count[p]` of them and is
    computed on `piece_rank[p]`. Every expert has a piece on its home rank (possibly empty); pieces on other
    ranks are replicas whose weights are sent there for the step."""

    num_ranks: int
    experts_per_rank: int
    piece_expert: list[int]
    piece_rank: list[int]
    piece_count: list[int]

    def home(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def pairs_per_rank(self) -> list[int]:
        """Token-expert pairs each rank computes under this plan."""
        pairs = [0] * self.num_ranks
        for rank, count in zip(self.piece_rank, self.piece_count):
            pairs[rank] += count
        return pairs

    def replicas(self) -> list[tuple[int, int]]:
        """(expert, rank) of every piece computed away from its home rank, sorted by expert."""
        return [(e, r) for e, r in zip(self.piece_expert, self.piece_rank) if r != self.home(e)]


def home_plan(counts_RE: torch.Tensor) -> ExpertPlan:
    """The plain EP plan: every expert computes all its pairs on its home rank."""
    num_ranks, num_experts = counts_RE.shape
    per_expert = counts_RE.sum(0).tolist()
    experts_per_rank = num_experts // num_ranks
    experts = list(range(num_experts))
    return ExpertPlan(num_ranks, experts_per_rank, experts, [e // experts_per_rank for e in experts], per_expert)


def _piece_overlap(counts_RE: torch.Tensor, plan: ExpertPlan) -> torch.Tensor:
    """Pairs that each source rank sends to each piece: [R, P] (int64).

    Within expert e, source r owns positions [prefix[r, e], prefix[r, e] + C[r, e]) of the expert's pair list;
    a piece owns a consecutive range of it; the overlap of the two ranges is what r sends to that piece."""
    device = counts_RE.device
    expert_P = torch.tensor(plan.piece_expert, dtype=torch.long, device=device)
    count_P = torch.tensor(plan.piece_count, dtype=torch.long, device=device)
    # Start of each piece within its expert: exclusive cumsum of counts, restarted at every expert.
    cum_P = count_P.cumsum(0) - count_P
    first_of_expert = torch.zeros(counts_RE.shape[1], dtype=torch.long, device=device)
    first_of_expert.scatter_reduce_(0, expert_P, cum_P, reduce="amin", include_self=False)
    piece_start_P = cum_P - first_of_expert[expert_P]
    piece_end_P = piece_start_P + count_P
    src_start_RE = counts_RE.cumsum(0) - counts_RE
    src_start_RP, src_end_RP = src_start_RE[:, expert_P], (src_start_RE + counts_RE)[:, expert_P]
    overlap = torch.minimum(src_end_RP, piece_end_P) - torch.maximum(src_start_RP, piece_start_P)
    return overlap.clamp_min(0)


def source_to_slot_order(counts_RS: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Gather index that reorders rows laid out source-major (source r, slot s) into slot-major (s, r).

    counts_RS [R, S] pairs per (source, slot), on the CPU -> index [M] on `device` with
    x_slot_major = x_source_major[index]. Only R*S numbers are worked on the host; the M-long index is
    built on `device` with its length known in advance, so no host sync."""
    device = device or counts_RS.device
    flat = counts_RS.reshape(-1)
    starts_RS = (flat.cumsum(0) - flat).view_as(counts_RS)
    counts_SR, starts_SR = counts_RS.t().reshape(-1), starts_RS.t().reshape(-1)
    total = int(flat.sum())
    # Each (s, r) segment is a run of consecutive source-major rows starting at starts_SR: the index is
    # arange(M) shifted, per segment, by (source start - slot-major start).
    shift_SR = (starts_SR - (counts_SR.cumsum(0) - counts_SR)).to(device)
    shift_M = shift_SR.repeat_interleave(counts_SR.to(device), output_size=total)
    return torch.arange(total, device=device) + shift_M


@dataclass
class DispatchStats:
    """What the last dispatch did, for tests and benchmarks."""

    pairs_per_rank: list[int]
    replicas: list[tuple[int, int]]
    sent_rows: int
    received_rows: int


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; older torch has only the first.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_counts(counts_E: torch.Tensor, group=None) -> torch.Tensor:
    """All ranks' per-expert pair counts, stacked: [R, E] (same on every rank). One collective."""
    world = dist.get_world_size(group)
    gathered = counts_E.new_empty(world * counts_E.numel())  # flat: gloo wants the output 1-D
    _all_gather_single(gathered, counts_E.contiguous(), group=group)
    return gathered.view(world, -1)


def exchange_replica_weights(plan: ExpertPlan, rank: int, w1_EFL: torch.Tensor, w3_EFL: torch.Tensor,
                             w2_ELF: torch.Tensor, group=None) -> tuple[list[int], torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
    """Send this rank's replicated experts to the ranks that compute them; receive the replicas placed here.

    w*_E.. are the local (home) experts [E/R, ...]. Returns (replica expert ids, w1 [n, F, L], w3 [n, F, L],
    w2 [n, L, F]) for the replicas computed on this rank, in ascending expert order. Differentiable: the
    backward sends the replicas' gradients back to their home rank."""
    first_home = rank * plan.experts_per_rank
    outgoing = sorted((dest, e) for e, dest in plan.replicas() if plan.home(e) == rank)
    incoming = [e for e, dest in plan.replicas() if dest == rank]
    input_splits = [0] * plan.num_ranks
    for dest, _ in outgoing:
        input_splits[dest] += 1
    output_splits = [0] * plan.num_ranks
    for e in incoming:
        output_splits[plan.home(e)] += 1
    width_F, width_L = w1_EFL.shape[1], w1_EFL.shape[2]
    # One row per sent expert: w1, w3 and w2 flattened side by side (each F*L values). Select before packing:
    # packing all home experts would copy every local weight each step (GBs per layer at K3's size).
    send_index = torch.tensor([e - first_home for _, e in outgoing], dtype=torch.long, device=w1_EFL.device)
    packed_n3X = torch.stack([w.index_select(0, send_index).flatten(1) for w in (w1_EFL, w3_EFL, w2_ELF)], dim=1)
    received = all_to_all(packed_n3X, output_splits, input_splits, group)
    n = received.shape[0]
    return (incoming, received[:, 0].reshape(n, width_F, width_L), received[:, 1].reshape(n, width_F, width_L),
            received[:, 2].reshape(n, width_L, width_F))


@dataclass
class Route:
    """Everything one step's dispatch and combine need, derived from the routing alone."""

    plan: ExpertPlan
    rank: int
    top_k: int
    input_splits: list[int]  # rows this rank sends to each rank
    output_splits: list[int]  # rows this rank receives from each rank
    send_perm_N: torch.Tensor  # local pair ids (t*K + k) in send order
    send_token_N: torch.Tensor  # the token of each sent row: send_perm_N // top_k
    unsend_perm_N: torch.Tensor  # inverse of send_perm_N: send order -> pair id
    slot_index_M: torch.Tensor  # received rows, source-major -> slot-major
    unslot_index_M: torch.Tensor  # inverse of slot_index_M
    slot_counts_S: torch.Tensor  # pairs per slot (expert computed here), on the tokens' device
    slot_experts: list[int]  # home experts (ascending), then the replicas placed here (ascending)
    group_slots: list[int]  # slots per weight group: [home] or [home, replicas]
    group_rows: list[int]  # received pairs per weight group

    def stats(self) -> DispatchStats:
        return DispatchStats(self.plan.pairs_per_rank(), self.plan.replicas(), sum(self.input_splits),
                             sum(self.output_splits))


def route(topk_ids_TK: torch.Tensor, experts_per_rank: int, plan_fn, group=None) -> Route:
    """Count, plan and compute the permutations for one step.

    topk_ids_TK [T, K] global expert ids; plan_fn: counts [R, E] -> ExpertPlan (home_plan or balanced_plan).
    One host sync (the all-gathered counts, which the split sizes need as Python ints); everything the
    host derives from them is O(R * pieces); the O(pairs) work stays on the tokens' device."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    num_experts = experts_per_rank * num_ranks
    device = topk_ids_TK.device
    ids_N = topk_ids_TK.reshape(-1)
    counts_E = torch.bincount(ids_N, minlength=num_experts)
    counts_RE = gather_counts(counts_E, group).cpu()  # the host sync
    plan = plan_fn(counts_RE)
    overlap_RP = _piece_overlap(counts_RE, plan)
    piece_rank_P = torch.tensor(plan.piece_rank, dtype=torch.long)

    # Split sizes from the counts alone: what this rank sends to each piece, summed per destination.
    input_splits = torch.zeros(num_ranks, dtype=torch.long).index_add_(0, piece_rank_P, overlap_RP[rank]).tolist()

    # Sender: pairs sorted by expert; each pair's position in its expert's global pair list decides the piece
    # (and rank) it goes to. Without replicas every piece is its expert's home, so the expert order is
    # already grouped by destination.
    order_N = ids_N.argsort(stable=True)
    if plan.replicas():
        expert_sorted_N = ids_N[order_N]
        per_expert_totals = counts_RE.sum(0)
        # Global position of this rank's first pair of each expert, minus its local expert-sorted start.
        offset_E = ((per_expert_totals.cumsum(0) - per_expert_totals) + (counts_RE.cumsum(0) - counts_RE)[rank]
                    - (counts_RE[rank].cumsum(0) - counts_RE[rank])).to(device)
        position_N = torch.arange(ids_N.numel(), device=device) + offset_E[expert_sorted_N]
        piece_end_P = torch.tensor(plan.piece_count, dtype=torch.long).cumsum(0).to(device)
        # Pieces are sorted by expert, so piece_end_P is a position in the global expert-major pair list.
        dest_N = piece_rank_P.to(device)[torch.searchsorted(piece_end_P, position_N, right=True)]
        # Grouped by destination, and inside each destination in its slot order: its home experts first, then
        # the replicas it computes (each part in expert order, kept by the stable sort).
        away_N = (expert_sorted_N // experts_per_rank != dest_N).long()
        send_perm_N = order_N[(dest_N * 2 + away_N).argsort(stable=True)]
    else:
        send_perm_N = order_N

    # Receiver: the pieces computed here are this rank's slots: its home experts first, then the replicas
    # placed here, each in ascending expert order. Two weight groups, so neither is copied into one stack.
    home = [p for p, r in enumerate(plan.piece_rank) if r == rank and plan.home(plan.piece_expert[p]) == rank]
    away = [p for p, r in enumerate(plan.piece_rank) if r == rank and plan.home(plan.piece_expert[p]) != rank]
    counts_RS = overlap_RP[:, home + away]
    slot_index_M = source_to_slot_order(counts_RS, device)
    pairs_S = counts_RS.sum(0)
    groups = [home, away] if plan.replicas() else [home]
    group_slots = [len(g) for g in groups]
    group_rows = [int(rows.sum()) for rows in pairs_S.split(group_slots)]
    return Route(plan, rank, topk_ids_TK.shape[1], input_splits, counts_RS.sum(1).tolist(), send_perm_N,
                 send_perm_N // topk_ids_TK.shape[1], inverse_permutation(send_perm_N), slot_index_M,
                 inverse_permutation(slot_index_M), pairs_S.to(device), [plan.piece_expert[p] for p in home + away],
                 group_slots, group_rows)


def dispatch(h_TL: torch.Tensor, routed: Route, group=None) -> torch.Tensor:
    """Send each pair's latent vector to the rank that computes it: h_TL [T, L] -> x [M, L], grouped by slot."""
    x_recv_ML = all_to_all(h_TL.index_select(0, routed.send_token_N), routed.output_splits, routed.input_splits,
                           group)
    return x_recv_ML.index_select(0, routed.slot_index_M)


def combine(y_slot_ML: torch.Tensor, routed: Route, group=None) -> torch.Tensor:
    """Return each pair's expert output to its token's rank: y [M, L] grouped by slot -> y_TKL [T, K, L]."""
    y_recv_ML = y_slot_ML.index_select(0, routed.unslot_index_M)
    y_sent_NL = all_to_all(y_recv_ML, routed.input_splits, routed.output_splits, group)
    return y_sent_NL.index_select(0, routed.unsend_perm_N).view(-1, routed.top_k, y_sent_NL.shape[-1])


def slot_weights(routed: Route, w1_EFL: torch.Tensor, w3_EFL: torch.Tensor, w2_ELF: torch.Tensor,
                 group=None) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The weights of this rank's slots, as groups (w1 groups, w3 groups, w2 groups): the home experts, then
    (if the plan has replicas anywhere) the replicas placed here, possibly none. Nothing is copied."""
    if not routed.plan.replicas():
        return [w1_EFL], [w3_EFL], [w2_ELF]
    # Every rank takes part in the weight exchange, even with nothing to send or receive.
    replica_ids, r1, r3, r2 = exchange_replica_weights(routed.plan, routed.rank, w1_EFL, w3_EFL, w2_ELF, group)
    first_home = routed.rank * routed.plan.experts_per_rank
    if list(range(first_home, first_home + routed.plan.experts_per_rank)) + replica_ids != routed.slot_experts:
        raise RuntimeError(f"expert plan inconsistent on rank {routed.rank}: slots {routed.slot_experts}, "
                           f"replica weights for {replica_ids}")
    return [w1_EFL, r1], [w3_EFL, r3], [w2_ELF, r2]


def compute_slots(x_slot_ML: torch.Tensor, routed: Route, w1: list[torch.Tensor], w3: list[torch.Tensor],
                  w2: list[torch.Tensor], act: str, betas: tuple[float, float]) -> torch.Tensor:
    """Grouped expert compute over this rank's slots, one grouped GEMM per weight group: x [M, L] -> y [M, L].

    w1, w3, w2: the weight groups from `slot_weights`."""
    outputs = []
    for x_ML, counts_S, g1, g3, g2 in zip(x_slot_ML.split(routed.group_rows),
                                          routed.slot_counts_S.split(routed.group_slots), w1, w3, w2):
        if x_ML.shape[0] == 0:
            # Nothing to compute in this group: keep the empty result wired to the inputs and weights, so this
            # rank runs the same backward collectives as the others (the replica exchange included) and its
            # experts get zero, not missing, gradients.
            outputs.append(x_ML.new_zeros(0, g2.shape[1]) + (x_ML.sum() + g1.sum() + g3.sum() + g2.sum()) * 0)
        else:
            outputs.append(run_experts(x_ML, counts_S, g1, g3, g2, act, betas))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def dispatch_compute_combine(h_TL: torch.Tensor, topk_ids_TK: torch.Tensor, plan_fn, w1_EFL: torch.Tensor,
                             w3_EFL: torch.Tensor, w2_ELF: torch.Tensor, act: str, betas: tuple[float, float],
                             group=None) -> tuple[torch.Tensor, DispatchStats]:
    """Run every routed pair through its expert, wherever the plan puts it.

    h_TL [T, L] local latent tokens, topk_ids_TK [T, K] global expert ids, w*: this rank's home experts
    [E/R, ...], plan_fn: counts [R, E] -> ExpertPlan. Returns y_TKL [T, K, L] (pair outputs in token order,
    unweighted) and the step's DispatchStats."""
    routed = route(topk_ids_TK, w1_EFL.shape[0], plan_fn, group)
    x_slot_ML = dispatch(h_TL, routed, group)
    w1, w3, w2 = slot_weights(routed, w1_EFL, w3_EFL, w2_ELF, group)
    y_slot_ML = compute_slots(x_slot_ML, routed, w1, w3, w2, act, betas)
    return combine(y_slot_ML, routed, group), routed.stats()
