"""The K3-shaped MoE layer under expert parallelism: plain against balanced dispatch, uniform and skewed routing.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 8 bench/ep_layer.py --json out.json   # 8 GPUs
    torchrun --standalone --nproc-per-node 2 bench/ep_layer.py --cpu --tiny        # gloo functional run

The layer is K3's LatentMoE (hidden 7168, latent 3584, expert width 3072, 896 experts, top-16, 2 shared experts),
its experts sharded over all ranks by k3.distributed.parallelize's expert placement (EP = world size: 112
experts per rank on 8 GPUs). Its other weights (router, latent projections, shared experts) are replicated, so
no FSDP collective is timed. For each tokens-per-rank count and each routing:

    uniform     every expert equally popular;
    maxvio=m    expert e's popularity ~ (e + 1) ** -s, s solved so that the expected expert loads have maxvio m
                (max load / mean load - 1 over the global batch, k3.layers.balancing.maxvio). The hottest
                experts all live on rank 0: the worst case for plain EP.

it reports, for the plain plan (every expert computed at home) and the balanced plan (pieces of hot experts
computed on under-loaded ranks, so every rank computes the same number of pairs):

    - dispatch and combine: latency and GB/s per rank, as bench/ep_dispatch.py defines them (bytes in the
      rank's send buffer, self-chunk included, / time; "bus" = x (R-1)/R, the part that leaves the rank),
      plus the routing metadata and, for the balanced plan, the exchange of replica weights;
    - expert compute per rank, forward and forward + backward (min and max over ranks);
    - the whole layer forward + backward (router, latent down-projection, dispatch, experts, combine,
      up-projection, shared experts): tokens/s per rank and in total;

and, once per run, the link peak: all_to_all_single of a large buffer (1 GiB per rank) and, on CUDA, a
peer-to-peer copy between the first two GPUs. Routing is forced: the router computes its scores as usual, then
the synthetic expert ids replace its top-k and the gate weights are its scores at those ids. Times are medians
over iterations of the slowest rank unless given per rank. Only rank 0 prints; --json writes every number.

Shape suffixes: T tokens per rank, K top-k, D hidden, L latent, E experts, M pairs received by a rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from common import print_table
from ep_dispatch import bench_all_to_all, gbps, local_median_seconds, routing_ids, say, sync, timed
from k3.atomic import atomic_write_bytes
from k3.config import ModelConfig
from k3.distributed import balanced_plan, home_plan, imbalance, init_distributed, is_main, shutdown
from k3.distributed.dispatcher import combine, compute_slots, dispatch, route, slot_weights
from k3.distributed.parallelize import EXPERT_WEIGHTS, apply_expert_parallel
from k3.layers.balancing import maxvio
from k3.layers.moe import LatentMoE, Router, Routing
from k3.layers.norm import RMSNorm
from k3.ops.moe import count_per_expert

K3_MOE = dict(hidden_size=7168, moe_latent_size=3584, moe_intermediate_size=3072, num_experts=896,
              num_experts_per_tok=16, num_shared_experts=2)
# Tiny: 8 experts, top-2 (the maxvio ceiling E/K - 1 = 3 leaves room for the target 2); with 2048 tokens per rank
# on 2 ranks the hottest expert's load has a sampling std of ~0.03 in maxvio.
TINY_MOE = dict(hidden_size=64, moe_latent_size=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                num_shared_experts=2)
TINY_TOKENS = [2048, 4096]
PLANS = {"plain": home_plan, "balanced": balanced_plan}
# Published, other hardware: DeepEP's normal kernels, intranode EP8 on H800 (~160 GB/s NVLink), 4096 tokens,
# hidden 7168, top-8, FP8 dispatch (7168 bytes per pair: the bytes of a bf16 latent of 3584) and BF16 combine.
DEEPEP_H800_EP8 = {"dispatch_gbps": 153.0, "combine_gbps": 158.0,
                   "setting": "DeepEP normal kernels, intranode EP8, H800 NVLink, 4096 tokens, hidden 7168, top-8, "
                              "FP8 dispatch, BF16 combine (README 'bottleneck bandwidth')"}
CPU_NOTE = "[CPU functional run: not a performance result]"


# --- skewed routing: the Zipf exponent for a target maxvio ----------------------------------------------------

def _fewer_than_k_fired(rates_J: torch.Tensor, t_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """P(fewer than top_k of independent exponential clocks with rates_J have fired by time t), for each t: [N]."""
    fired_JN1 = (-torch.expm1(-rates_J[:, None] * t_N[None, :])).unsqueeze(-1)
    exactly_NK = torch.zeros(t_N.numel(), top_k, dtype=torch.float64)  # P(exactly k fired), k < top_k
    exactly_NK[:, 0] = 1.0
    for fired_N1 in fired_JN1:  # add one clock at a time: a Poisson-binomial distribution, truncated at top_k
        moved_NK = exactly_NK[:, :-1] * fired_N1
        exactly_NK *= 1.0 - fired_N1
        exactly_NK[:, 1:] += moved_NK
    return exactly_NK.sum(1)


def pick_probability(skew: float, num_experts: int, top_k: int, expert: int = 0, points: int = 2049) -> float:
    """Probability that a token of `routing_ids(..., skew)` picks `expert` (expert 0 is the most popular).

    routing_ids keeps the top-k of log(u_e) / p_e, u uniform: the k first to fire of independent exponential
    clocks with rates p_e (-log u / p ~ Exp(p)), i.e. k draws without replacement proportional to popularity.
    Expert e is picked iff its clock fires before the k-th of the others:

        pi_e = integral over t of p_e exp(-p_e t) P(fewer than k others fired by t) dt

    integrated on a log-spaced grid (the integrand spans many scales under strong skew); below the grid no
    other clock has fired (the probability is 1 up to ~1e-9) and that part is integrated in closed form."""
    rates_E = (torch.arange(num_experts, dtype=torch.float64) + 1) ** -skew
    rates_E = rates_E / rates_E.sum()
    others_J = torch.cat([rates_E[:expert], rates_E[expert + 1:]])
    # Past t_max, k or more of the others have fired with certainty (to float64 precision).
    candidates = top_k * 2.0 ** torch.arange(-4, 80, dtype=torch.float64)
    t_max = float(candidates[int((_fewer_than_k_fired(others_J, candidates, top_k) > 1e-16).sum())])
    t_min = 1e-9 / float(rates_E.max())
    log_t_N = torch.linspace(math.log(t_min), math.log(t_max), points, dtype=torch.float64)
    t_N = log_t_N.exp()
    rate = rates_E[expert]
    density_N = rate * torch.exp(-rate * t_N) * _fewer_than_k_fired(others_J, t_N, top_k) * t_N  # d/d(log t)
    return float(-torch.expm1(-rate * t_min) + torch.trapezoid(density_N, log_t_N))


def expected_maxvio(skew: float, num_experts: int, top_k: int) -> float:
    """maxvio of the expected loads: the hottest expert's share of tokens over the mean share k / E, minus 1."""
    return pick_probability(skew, num_experts, top_k) * num_experts / top_k - 1.0


def solve_zipf_exponent(target: float, num_experts: int, top_k: int, tolerance: float = 1e-4) -> float:
    """The skew s >= 0 whose expected loads have maxvio `target` (to within `tolerance`), by bisection: the
    hottest expert's expected load grows monotonically with s."""
    ceiling = num_experts / top_k - 1.0
    if not 0.0 <= target < ceiling:
        raise ValueError(f"maxvio target {target} is out of reach: with {num_experts} experts and top-{top_k} the "
                         f"hottest expert takes at most every token (maxvio {ceiling:g}); use a target in "
                         f"[0, {ceiling:g})")
    if target == 0.0:
        return 0.0
    low, high = 0.0, 1.0
    while expected_maxvio(high, num_experts, top_k) < target:
        low, high = high, 2.0 * high
    while True:
        middle = 0.5 * (low + high)
        got = expected_maxvio(middle, num_experts, top_k)
        if abs(got - target) <= tolerance or high - low < 1e-12:
            return middle
        low, high = (middle, high) if got < target else (low, middle)


def maxvio_sampling_std(target: float, num_experts: int, top_k: int, global_tokens: int) -> float:
    """Standard deviation of the realised maxvio around a target, from the hottest expert's load alone: each
    token picks it independently with probability pi = (1 + target) k / E, and the mean load T k / E is exact
    (every token picks exactly k experts), so maxvio - target = (binomial(T, pi) - T pi) / (T k / E)."""
    share = (1.0 + target) * top_k / num_experts
    return math.sqrt(global_tokens * share * (1.0 - share)) / (global_tokens * top_k / num_experts)


# --- the layer ------------------------------------------------------------------------------------------------

def build_layer(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int) -> LatentMoE:
    """K3's LatentMoE with its experts sharded over all ranks (EP = world size), placed as parallelize does.

    Built on the meta device and materialised after sharding: the full expert stack (59 GB in bf16 at K3's
    size) never exists on one device; each rank allocates and initialises only its own block."""
    with torch.device("meta"):
        moe = LatentMoE(config).to(dtype)
    world = dist.get_world_size()
    expert_mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("edp", "ep"))  # one EP group
    apply_expert_parallel(nn.ModuleList([moe]), expert_mesh, balanced=False)
    moe.to_empty(device=device)
    std = config.initializer_range
    with torch.no_grad():
        torch.manual_seed(seed)  # the replicated weights: equal on every rank
        for module in moe.modules():
            if isinstance(module, (nn.Linear, Router)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        moe.gate.e_score_correction_bias.zero_()
        torch.manual_seed(seed + 1 + dist.get_rank())  # this rank's expert block
        for name in EXPERT_WEIGHTS:
            nn.init.normal_(getattr(moe, name).to_local(), std=std)
    return moe


class ForcedRouting:
    """Stands in for a Router's forward: the router computes its scores (and top-k) as usual, then `topk_ids_TK`
    replaces its choice; the gate weights are the router's own for those ids (Router.gate_weights)."""

    def __init__(self, router: Router) -> None:
        self.router, self.router_forward = router, router.forward
        self.topk_ids_TK: torch.Tensor | None = None
        router.forward = self

    def __call__(self, x_TD: torch.Tensor) -> Routing:
        routing = self.router_forward(x_TD)
        weights_TK = self.router.gate_weights(routing.logits_TE, routing.scores_TE, self.topk_ids_TK)
        return Routing(self.topk_ids_TK, weights_TK, routing.scores_TE, routing.logits_TE)


# --- measurements ---------------------------------------------------------------------------------------------

def each_rank(value: float, device: torch.device) -> list[float]:
    """Every rank's value, in rank order."""
    local = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [float(v) for v in gathered]


def global_max(value: float, device: torch.device) -> float:
    reduced = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return float(reduced)


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors of slot_weights' result (tensors, or lists of tensors per weight group), flattened."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in tensors_in(item)]


def as_leaves(value):
    """slot_weights' result with every tensor detached into a leaf that requires grad (same structure)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(True)
    return type(value)(as_leaves(item) for item in value)


def peer_copy_gbps(mib: float, device: torch.device, warmup: int, iters: int) -> float | None:
    """Rank 0 copies `mib` MiB from its GPU to the next GPU of the host while the others wait; None off CUDA or
    without peer access between the two (rank 0's answer, on every rank)."""
    rate = torch.full((1,), -1.0, dtype=torch.float64, device=device)  # -1: not measured
    if device.type == "cuda" and dist.get_rank() == 0 and torch.cuda.device_count() > 1:
        peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
        if torch.cuda.can_device_access_peer(device, peer):
            source = torch.empty(int(mib * 2**20), dtype=torch.uint8, device=device)
            target = torch.empty_like(source, device=peer)

            def copy() -> None:
                target.copy_(source)
                torch.cuda.synchronize(device)
                torch.cuda.synchronize(peer)

            rate[0] = gbps(source.numel(), local_median_seconds_alone(copy, warmup, iters))
    dist.broadcast(rate, 0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return float(rate) if float(rate) >= 0 else None


def local_median_seconds_alone(fn, warmup: int, iters: int) -> float:
    """Median seconds of fn() (which synchronises itself) on this rank only: no barrier, the others wait."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def link_peak(args, device: torch.device, dtype: torch.dtype) -> dict:
    world = dist.get_world_size()
    say(f"\nlink peak (same run): all_to_all_single, {args.a2a_mib:g} MiB per rank")
    rate = bench_all_to_all([args.a2a_mib], device, dtype, args.warmup, args.iters)[args.a2a_mib]
    peer = peer_copy_gbps(args.a2a_mib, device, args.warmup, args.iters)
    if peer is not None:
        say(f"  peer copy GPU{device.index} -> GPU{(device.index + 1) % torch.cuda.device_count()} "
            f"{args.a2a_mib:g} MiB: {peer:7.1f} GB/s")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"all_to_all_mib": args.a2a_mib, "all_to_all_gbps": rate, "all_to_all_bus_gbps": rate * (world - 1) / world,
            "peer_copy_gbps": peer}


def time_expert_compute(moe: LatentMoE, routed, x_slot_ML: torch.Tensor, home_weights: list[torch.Tensor], args,
                        device: torch.device) -> tuple[list[float], list[float]]:
    """Each rank's expert compute on its own slots, forward and forward + backward: [seconds per rank] twice.
    The replica weights are fetched once beforehand, so no collective runs inside the timed part."""
    group = moe.ep_mesh.get_group()
    weights = as_leaves(slot_weights(routed, *home_weights, group))
    leaves = [x_slot_ML.detach().requires_grad_(True)] + tensors_in(weights)
    grad_ML = torch.randn_like(x_slot_ML)

    def forward() -> None:
        with torch.no_grad():
            compute_slots(leaves[0], routed, *weights, moe.act, moe.betas)

    def forward_backward() -> None:
        for leaf in leaves:
            leaf.grad = None
        compute_slots(leaves[0], routed, *weights, moe.act, moe.betas).backward(grad_ML)

    return (each_rank(local_median_seconds(forward, device, args.warmup, args.iters), device),
            each_rank(local_median_seconds(forward_backward, device, args.warmup, args.iters), device))


def time_layer(moe: LatentMoE, x_TD: torch.Tensor, grad_TD: torch.Tensor, args,
               device: torch.device) -> tuple[float, tuple[torch.Tensor, ...]]:
    """The whole layer, forward + backward, gradients freed before every step as in training: the slowest rank's
    median seconds, and one step's output, input gradient and expert gradients (this rank's)."""
    x_leaf_TD = x_TD.detach().requires_grad_(True)

    def step() -> torch.Tensor:
        moe.zero_grad(set_to_none=True)
        x_leaf_TD.grad = None
        out_TD = moe(x_leaf_TD)
        out_TD.backward(grad_TD)
        return out_TD.detach()

    seconds = timed(step, device, args.warmup, args.iters)
    out_TD = step()
    captured = (out_TD, x_leaf_TD.grad, *(getattr(moe, name).grad.to_local() for name in EXPERT_WEIGHTS))
    moe.zero_grad(set_to_none=True)
    return seconds, captured


def bench_plan(moe: LatentMoE, forced: ForcedRouting, plan_name: str, ids_TK: torch.Tensor, x_TD: torch.Tensor,
               h_TL: torch.Tensor, grad_TD: torch.Tensor, args, device: torch.device) -> tuple[dict, tuple]:
    """Every measurement of one plan on one case; returns them and the layer's output and gradients."""
    world = dist.get_world_size()
    plan_fn, group = PLANS[plan_name], moe.ep_mesh.get_group()
    experts_per_rank = moe.w1.to_local().shape[0]
    num_bytes = ids_TK.numel() * h_TL.shape[1] * h_TL.element_size()

    def run(fn) -> float:
        return timed(fn, device, args.warmup, args.iters)

    routed = route(ids_TK, experts_per_rank, plan_fn, group)
    pairs, replicas = routed.plan.pairs_per_rank(), routed.plan.replicas()
    t_route = run(lambda: route(ids_TK, experts_per_rank, plan_fn, group))
    x_slot_ML = dispatch(h_TL, routed, group)
    t_dispatch = run(lambda: dispatch(h_TL, routed, group))
    t_combine = run(lambda: combine(x_slot_ML, routed, group))  # y has x's shape: [M, L]
    home_weights = [getattr(moe, name).to_local().detach() for name in EXPERT_WEIGHTS]
    t_replicas = run(lambda: slot_weights(routed, *home_weights, group)) if replicas else None
    t_forward, t_step = time_expert_compute(moe, routed, x_slot_ML, home_weights, args, device)

    moe.balanced = plan_name == "balanced"
    forced.topk_ids_TK = ids_TK
    t_layer, captured = time_layer(moe, x_TD, grad_TD, args, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    tokens = ids_TK.shape[0]
    rate_dispatch, rate_combine = gbps(num_bytes, t_dispatch), gbps(num_bytes, t_combine)
    return {
        "pairs_per_rank": pairs, "max_over_mean": imbalance(pairs), "replicas": len(replicas),
        "route_s": t_route, "dispatch_s": t_dispatch, "combine_s": t_combine, "replica_weights_s": t_replicas,
        "bytes_per_rank": num_bytes, "dispatch_gbps": rate_dispatch, "combine_gbps": rate_combine,
        "dispatch_bus_gbps": rate_dispatch * (world - 1) / world, "combine_bus_gbps": rate_combine * (world - 1) / world,
        "expert_forward_s": t_forward, "expert_forward_min_s": min(t_forward), "expert_forward_max_s": max(t_forward),
        "expert_step_s": t_step, "expert_step_min_s": min(t_step), "expert_step_max_s": max(t_step),
        "layer_step_s": t_layer, "layer_tokens_per_s_per_rank": tokens / t_layer,
        "layer_tokens_per_s_total": world * tokens / t_layer,
    }, captured


def compare_outputs(plain: tuple, balanced: tuple, device: torch.device) -> dict:
    """Largest difference (over ranks) between the plain and the balanced layer in its output, input gradient
    and expert gradients, each with the largest magnitude of the plain value, for scale."""
    names = ("output", "input_grad", *(f"{name}_grad" for name in EXPERT_WEIGHTS))
    result = {}
    for name, a, b in zip(names, plain, balanced):
        # In slices of ~64M values: at K3's size an expert gradient block is GBs, and float copies of it more.
        rows = max(1, 2**26 // max(1, a[0].numel())) if a.numel() else 1
        diff = max((float((x.float() - y.float()).abs().max()) for x, y in zip(a.split(rows), b.split(rows))),
                   default=0.0)
        result[name] = {"max_abs_diff": global_max(diff, device),
                        "max_abs": global_max(float(a.abs().max()) if a.numel() else 0.0, device)}
    return result


def bench_case(moe: LatentMoE, forced: ForcedRouting, tokens: int, routing: dict, args, device: torch.device,
               dtype: torch.dtype, generator: torch.Generator) -> dict:
    world = dist.get_world_size()
    num_experts, top_k = moe.w1.shape[0], moe.top_k
    ids_TK = routing_ids(tokens, num_experts, top_k, routing["zipf_exponent"], device, generator)
    load_E = count_per_expert(ids_TK, num_experts).double()
    dist.all_reduce(load_E)
    x_TD = torch.randn(tokens, moe.gate.weight.shape[1], generator=generator).to(device, dtype)
    grad_TD = torch.randn(x_TD.shape, generator=generator).to(device, dtype)
    with torch.no_grad():
        h_TL = moe.routed_expert_down_proj(x_TD)
    case = {"tokens_per_rank": tokens, "global_tokens": world * tokens, **routing, "realised_maxvio": maxvio(load_E)}
    if routing["target_maxvio"] is not None:
        case["maxvio_sampling_std"] = maxvio_sampling_std(routing["target_maxvio"], num_experts, top_k, world * tokens)
    plans, captured = {}, {}
    for name in PLANS:
        plans[name], captured[name] = bench_plan(moe, forced, name, ids_TK, x_TD, h_TL, grad_TD, args, device)
    case["plans"] = plans
    case["plain_vs_balanced"] = compare_outputs(captured["plain"], captured["balanced"], device)
    return case


def print_case(case: dict, link: dict) -> None:
    if not is_main():
        return
    target = case["target_maxvio"]
    routing = ("uniform" if target is None else f"maxvio target {target:g} (popularity ~ (e+1)^-"
               f"{case['zipf_exponent']:.4f}, sampling std {case['maxvio_sampling_std']:.3f})")
    ms = 1e3
    transport, compute = [], []
    for name, plan in case["plans"].items():
        replica_ms = "-" if plan["replica_weights_s"] is None else plan["replica_weights_s"] * ms
        transport.append([name, plan["max_over_mean"], plan["replicas"], plan["route_s"] * ms, plan["dispatch_s"] * ms,
                          plan["dispatch_gbps"], plan["dispatch_bus_gbps"], plan["combine_s"] * ms,
                          plan["combine_gbps"], plan["combine_bus_gbps"], replica_ms])
        compute.append([name, plan["expert_forward_min_s"] * ms, plan["expert_forward_max_s"] * ms,
                        plan["expert_step_min_s"] * ms, plan["expert_step_max_s"] * ms, plan["layer_step_s"] * ms,
                        plan["layer_tokens_per_s_per_rank"], plan["layer_tokens_per_s_total"]])
    title = f"{case['tokens_per_rank']} tokens/rank, {routing}: realised maxvio {case['realised_maxvio']:.3f}"
    print_table(f"{title} - transport", ["dispatch", "pairs max/mean", "replicas", "route ms", "dispatch ms",
                                         "GB/s", "bus", "combine ms", "GB/s", "bus", "replica w. ms"], transport)
    print_table(f"{title} - compute (expert: per rank, min/max; layer: fwd+bwd)",
                ["dispatch", "expert fwd ms min", "max", "expert fwd+bwd ms min", "max", "layer fwd+bwd ms",
                 "tokens/s per rank", "tokens/s total"], compute)
    peer = "" if link["peer_copy_gbps"] is None else f", peer copy {link['peer_copy_gbps']:.1f} GB/s"
    print(f"  link peak in this run: all_to_all_single {link['all_to_all_gbps']:.1f} GB/s per rank "
          f"(bus {link['all_to_all_bus_gbps']:.1f}){peer}")
    print(f"  published anchor (other hardware): DeepEP intranode EP8 on H800 ~{DEEPEP_H800_EP8['dispatch_gbps']:.0f} "
          f"GB/s dispatch, ~{DEEPEP_H800_EP8['combine_gbps']:.0f} GB/s combine (NVLink bytes: compare with 'bus')")
    print("  plain vs balanced layer, max |difference| / max |plain value|: " + ", ".join(
        f"{name} {diff['max_abs_diff'] / max(diff['max_abs'], 1e-30):.2g}"
        for name, diff in case["plain_vs_balanced"].items()), flush=True)


def command_line(world: int) -> str:
    nvls = f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} " if "NCCL_NVLS_ENABLE" in os.environ else ""
    return f"{nvls}torchrun --standalone --nproc-per-node {world} " + " ".join(shlex.quote(a) for a in sys.argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU (functional run)")
    parser.add_argument("--tiny", action="store_true", help="tiny layer dimensions (CPU functional run)")
    parser.add_argument("--tokens", type=int, nargs="+", help="tokens per rank (default 4096 8192; tiny: "
                        f"{' '.join(map(str, TINY_TOKENS))})")
    parser.add_argument("--maxvio", type=float, nargs="*", default=[0.5, 2.0],
                        help="maxvio targets of the skewed routings (uniform routing always runs)")
    parser.add_argument("--a2a-mib", type=float, default=1024, help="MiB per rank of the link-peak all_to_all")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every number here (rank 0, atomically)")
    args = parser.parse_args()
    dims = TINY_MOE if args.tiny else K3_MOE
    if args.tiny:
        args.a2a_mib, args.warmup, args.iters = 4, 1, 3
    args.tokens = args.tokens or (TINY_TOKENS if args.tiny else [4096, 8192])
    env = init_distributed(device="cpu" if args.cpu else None)
    if env.world_size < 2:
        raise SystemExit("run under torchrun with at least 2 processes, e.g. torchrun --nproc-per-node 2 ...")
    if dims["num_experts"] % env.world_size:
        raise SystemExit(f"{dims['num_experts']} experts do not split over {env.world_size} ranks; run with a "
                         f"number of processes that divides {dims['num_experts']}")
    device = env.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # moe_balancing "none": the routing is forced, so the router's balancing bias would have no effect.
    config = ModelConfig.from_preset("k3", **dims, moe_balancing="none")
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    say(f"command: {command_line(env.world_size)}")
    say(f"{env.world_size} ranks, backend {env.backend}, device {device.type}, {dtype}"
        + (f"  {CPU_NOTE}" if device.type == "cpu" else ""))
    say(f"layer: hidden {config.hidden_size}, latent {config.moe_latent_size}, expert width "
        f"{config.moe_intermediate_size}, {num_experts} experts (top-{top_k}, {num_experts // env.world_size} "
        f"per rank), {config.num_shared_experts} shared experts")
    routings = [{"routing": "uniform", "target_maxvio": None, "zipf_exponent": 0.0, "expected_maxvio": 0.0}]
    for target in args.maxvio:
        skew = solve_zipf_exponent(target, num_experts, top_k)
        routings.append({"routing": f"maxvio={target:g}", "target_maxvio": target, "zipf_exponent": skew,
                         "expected_maxvio": expected_maxvio(skew, num_experts, top_k)})
        say(f"maxvio target {target:g}: Zipf exponent {skew:.5f} (expected maxvio "
            f"{routings[-1]['expected_maxvio']:.5f})")
    link = link_peak(args, device, dtype)
    moe = build_layer(config, device, dtype, args.seed)
    forced = ForcedRouting(moe.gate)
    generator = torch.Generator().manual_seed(args.seed + 1000 * (1 + env.rank))
    cases = []
    for tokens in args.tokens:
        for routing in routings:
            cases.append(bench_case(moe, forced, tokens, routing, args, device, dtype, generator))
            print_case(cases[-1], link)
    sync(device)
    if args.json and is_main():
        result = {"command": command_line(env.world_size), "world_size": env.world_size, "backend": env.backend,
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "cpu_functional_run": device.type == "cpu", "dtype": str(dtype), "torch": torch.__version__,
                  "layer": dims, "warmup": args.warmup, "iters": args.iters, "link_peak": link,
                  "published_anchor": DEEPEP_H800_EP8, "cases": cases}
        atomic_write_bytes(args.json, json.dumps(result, indent=1).encode())
        say(f"\nwrote {args.json}")
    shutdown()  # not in a finally: its barrier would hang a rank whose peer raised
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
