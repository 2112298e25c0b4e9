"""Apply expert parallelism and FSDP2 to a single-device K3ForCausalLM, from outside, in a fixed order:

    1. EP: each LatentMoE becomes an ExpertParallelMoE (a subclass swapped onto the same object, so
       parameter names stay `...block_sparse_moe.w1/w3/w2` and checkpoints load unchanged); its stacked
       experts become DTensors sharded along the expert dimension over its EP group, and its routed path
       goes through the all-to-all dispatcher (plain or balanced) within that group.
    2. FSDP2: `fully_shard` on the embedding, every layer's attention and feed-forward, the LM head, then
       the root (norms and AttnRes mixes), over all ranks, ignoring the expert parameters EP already placed.
    3. Balancing: each router's `gather` is set so QB (solved in the training forward) concatenates the
       required-bias matrix over all ranks, and `model.update_balancers()` is rebound so loss-free balancing
       all-reduces the loads over all ranks: every rank computes identical router biases from the global batch.

Layouts, for W ranks and EP size P (P divides W and the expert count):

    P = 1   plain FSDP: experts sharded by FSDP like every other weight.
    P = W   every rank is a data-parallel rank and an EP rank.
    1 < P < W   a 2D mesh (edp, ep) of shape (W/P, P) over ranks 0..W-1 in row-major order: an EP group is
            P consecutive ranks (on GPUs, those of one node), and each group holds a whole copy of the
            experts, sharded over its P ranks. The W/P groups are data-parallel replicas of the experts (the
            "edp" dim): rank r's edp peers hold the same expert block in the other groups.

Gradient scale (the global loss is the mean of the ranks' local mean losses, with equal local batches): FSDP
averages the non-expert gradients over all W ranks. An expert's gradient arrives as the sum of its EP group's
contributions through the all-to-all backward; the backward of `_ExpertGradMean` (one node per MoE layer)
then sums it over the W/P replicas (all-reduce over the "edp" peers) and scales it by 1/W, so every replica
of an expert gets the same gradient (the mean over all ranks) and the replicas stay identical after every
optimizer step. This is the gradient FSDP over the edp dim would give; the experts are replicated rather than
sharded over edp because an FSDP unit has one mesh and w1/w3/w2 sit on the LatentMoE itself, next to the
router and shared expert whose gradients must be averaged over all ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from k3.distributed.balanced import balanced_plan
from k3.distributed.dispatcher import DispatchStats, dispatch_compute_combine, home_plan
from k3.distributed.launch import all_gather_cat, all_reduce_op, all_reduce_sum, get_world_size
from k3.layers.balancing import QB_AGGREGATES
from k3.layers.moe import LatentMoE, Routing, weighted_sum_over_k

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class _ExpertGradMean(torch.autograd.Function):
    """Identity on this rank's expert blocks (w1, w3, w2) in forward. In backward their gradients (already
    summed over the EP group by the all-to-all backward) are summed over the expert replicas (`group`, the
    edp dim; None when there is a single replica) and scaled by `scale` = 1/world: the mean over all ranks.

    One node for the three weights, so every rank runs the same collectives in the same order."""

    @staticmethod
    def forward(ctx, scale: float, group, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
        ctx.scale, ctx.group = scale, group
        ctx.layouts = [(w.shape, w.dtype, w.device) for w in (w1, w3, w2)]
        return w1.view_as(w1), w3.view_as(w3), w2.view_as(w2)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        means = []
        for grad, (shape, dtype, device) in zip(grads, ctx.layouts):
            # A weight whose output got no gradient still takes part, so the collectives match across ranks.
            mean = torch.zeros(shape, dtype=dtype, device=device) if grad is None else (grad * ctx.scale).contiguous()
            if ctx.group is not None:
                dist.all_reduce(mean, op=dist.ReduceOp.SUM, group=ctx.group)
            means.append(mean)
        return (None, None, *means)


class ExpertParallelMoE(LatentMoE):
    """LatentMoE with its routed experts spread over EP ranks (made by `parallelize`, never constructed).

    w1/w3/w2 are DTensors [E, ...] sharded on dim 0 over the EP mesh (this rank's EP group of P ranks); this
    rank computes with its local block [E/P, ...] plus, in balanced mode, the replicas the plan places here.
    replica_group: the process group of the ranks holding the same block in the other EP groups (None when
    the EP group spans every rank)."""

    ep_mesh: DeviceMesh
    replica_group: dist.ProcessGroup | None
    balanced: bool
    grad_scale: float
    last_dispatch: DispatchStats | None

    def routed_latent(self, h_TL: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts over EP ranks and their weighted sum: [T, L] -> [T, L] (T local tokens)."""
        w1, w3, w2 = _ExpertGradMean.apply(self.grad_scale, self.replica_group,
                                           *(getattr(self, name).to_local() for name in EXPERT_WEIGHTS))
        plan_fn = balanced_plan if self.balanced else home_plan
        y_TKL, self.last_dispatch = dispatch_compute_combine(
            h_TL, routing.topk_ids_TK, plan_fn, w1, w3, w2, self.act, self.betas, self.ep_mesh.get_group())
        # The single-device combine (deterministic batched matmul over K), so both layouts compute the same sums.
        return weighted_sum_over_k(y_TKL, routing.topk_weights_TK)


@dataclass
class ParallelLayout:
    world_size: int
    ep_size: int
    fsdp: bool
    balanced: bool
    mesh: DeviceMesh | None  # 1D ("dp",) over all ranks: FSDP2 of the non-expert weights
    expert_mesh: DeviceMesh | None = None  # 2D ("edp", "ep") of shape (world / ep, ep) when ep > 1


def _moe_modules(model: nn.Module) -> list[LatentMoE]:
    return [m for m in model.modules() if isinstance(m, LatentMoE)]


def check_ep_size(ep_size: int, world_size: int, num_experts: int | None) -> None:
    """Raise ValueError unless `ep_size` ranks can hold the experts: it must divide both the world size (the
    EP groups tile the ranks) and the expert count (every EP rank holds the same number of experts).
    num_experts None: a model without MoE layers (only the world size matters)."""
    experts = num_experts or world_size
    choices = (f"use an EP size that divides both the {world_size} ranks and the {experts} experts: "
               f"{_divisors_of_both(world_size, experts)}")
    if world_size == 1 and ep_size > 1:
        choices += f" (for EP={ep_size}, launch {ep_size} or a multiple of {ep_size} processes with torchrun)"
    if ep_size < 1:
        raise ValueError(f"ep_size (--ep) must be at least 1 (1: no expert parallelism), got {ep_size}; {choices}")
    if world_size % ep_size:
        raise ValueError(f"ep_size (--ep) {ep_size} does not split the {world_size} ranks into whole EP groups; "
                         f"{choices}")
    if experts % ep_size:
        raise ValueError(f"{experts} experts cannot be split evenly over EP={ep_size} ranks; {choices}")


def _divisors_of_both(a: int, b: int) -> list[int]:
    return [d for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0]


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh, balanced: bool) -> set[nn.Parameter]:
    ep_mesh = expert_mesh["ep"]
    replicas = expert_mesh.size(0)
    replica_group = expert_mesh.get_group("edp") if replicas > 1 else None
    placed: set[nn.Parameter] = set()
    for moe in _moe_modules(model):
        for name in EXPERT_WEIGHTS:
            # The first rank of each EP group scatters its weights; every rank starts from the same experts
            # (same seed), so the replicas in the other groups start equal too.
            sharded = nn.Parameter(distribute_tensor(getattr(moe, name).detach(), ep_mesh, [Shard(0)]))
            setattr(moe, name, sharded)
            placed.add(sharded)
        moe.__class__ = ExpertParallelMoE
        moe.ep_mesh = ep_mesh
        moe.replica_group = replica_group
        moe.balanced = balanced
        moe.grad_scale = 1.0 / expert_mesh.size()
        moe.last_dispatch = None
    return placed


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards as units, in forward order; the root gets what is left (norms, AttnRes mixes).

    A decoder layer itself cannot be a unit: its block-AttnRes form is a method other than forward, which
    FSDP's hooks do not see, so its attention and feed-forward (each entered through __call__ with tensors
    in and out) are the units instead."""
    units: list[nn.Module] = [model.model.embed_tokens]
    for layer in model.model.layers:
        units.append(layer.self_attn)
        units.append(layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp)
    units.append(model.lm_head)
    return units


def _wire_balancers(model: nn.Module, qb_aggregate: str) -> None:
    """Every rank aggregates the same statistics, so biases stay identical: QB solves its bias inside the
    training forward from the required-bias matrix gathered over ranks ("gather": exact, [T, E] floats from
    every rank per MoE layer) or from all-reduced histograms ("histogram": E x 256 counts per round, a few
    rounds; the same expert loads, biases equal to ~1e-3); the loss-free update sums loads."""
    for _, router in model.routers():
        if qb_aggregate == "histogram":
            router.reduce = all_reduce_op
        else:
            router.gather = all_gather_cat
    single_device = type(model).update_balancers
    model.update_balancers = functools.partial(single_device, model, all_reduce=all_reduce_sum)


def parallelize(model: nn.Module, ep_size: int = 1, fsdp: bool = True, balanced: bool = False,
                qb_aggregate: str = "gather") -> nn.Module:
    """Shard `model` (a K3ForCausalLM already on this rank's device, created with the same seed on every rank)
    over all ranks in place and return it.

    ep_size: ranks per EP group; must divide the world size and the expert count. 1: no EP (plain FSDP);
    the world size: experts over every rank; in between: world / ep_size EP groups, each holding all experts
    (data-parallel replicas of them). fsdp: shard the non-expert weights with FSDP2 over all ranks (required
    when more than one rank: it is what keeps their gradients in sync). balanced: MoonEP-style balanced
    dispatch within each EP group. qb_aggregate: how Quantile Balancing pools its statistics over ranks,
    "gather" or "histogram" (see _wire_balancers)."""
    if qb_aggregate not in QB_AGGREGATES:
        raise ValueError(f"qb_aggregate must be one of {QB_AGGREGATES}, got {qb_aggregate!r}")
    world = get_world_size()
    moes = _moe_modules(model)
    check_ep_size(ep_size, world, moes[0].w1.shape[0] if moes else None)
    if world > 1 and not fsdp:
        raise ValueError("with more than one rank the non-expert weights need FSDP to keep gradients in sync; "
                         "use fsdp=True")
    if balanced and ep_size == 1:
        raise ValueError("balanced dispatch needs expert parallelism; use ep_size > 1 or balanced=False")
    layout = ParallelLayout(world, ep_size, fsdp, balanced, None)
    if world > 1:
        device_type = next(model.parameters()).device.type
        if device_type == "meta":  # built without storage (build_parallel_model): the ranks' own device kind
            device_type = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        layout.mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
        ignored: set[nn.Parameter] = set()
        if ep_size > 1:
            layout.expert_mesh = init_device_mesh(device_type, (world // ep_size, ep_size),
                                                  mesh_dim_names=("edp", "ep"))
            ignored = apply_expert_parallel(model, layout.expert_mesh, balanced)
        for unit in _fsdp_units(model):
            fully_shard(unit, mesh=layout.mesh, ignored_params=ignored)
        fully_shard(model, mesh=layout.mesh, ignored_params=ignored)
        _wire_balancers(model, qb_aggregate)
    model.parallel_layout = layout
    return model


def set_balanced(model: nn.Module, balanced: bool) -> None:
    """Switch every EP MoE layer between the plain and the balanced dispatch."""
    for moe in _moe_modules(model):
        if isinstance(moe, ExpertParallelMoE):
            moe.balanced = balanced


def dispatch_stats(model: nn.Module) -> list[DispatchStats]:
    """The last dispatch of every EP MoE layer, in layer order."""
    return [m.last_dispatch for m in _moe_modules(model)
            if isinstance(m, ExpertParallelMoE) and m.last_dispatch is not None]


def global_moe_maxvio(model: nn.Module) -> dict[int, float]:
    """maxvio of the last forward per MoE layer, over the global batch (loads summed over ranks)."""
    from k3.layers.balancing import maxvio

    result = {}
    for index, router in model.routers():
        if router.last_load_E is not None:
            result[index] = maxvio(all_reduce_sum(router.last_load_E.clone()))
    return result


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A parameter's full value whatever its layout (collective for DTensors: call on every rank)."""
    return value.full_tensor() if isinstance(value, DTensor) else value
