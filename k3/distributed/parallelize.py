"""Apply expert parallelism and FSDP2 to a single-device K3ForCausalLM, from outside, in a fixed order:

    1. EP: each LatentMoE becomes an ExpertParallelMoE (a subclass swapped onto the same object, so
       parameter names stay `...block_sparse_moe.w1/w3/w2` and checkpoints load unchanged); its stacked
       experts become DTensors sharded along the expert dimension over the EP ranks, and its routed path
       goes through the all-to-all dispatcher (plain or balanced).
    2. FSDP2: `fully_shard` on the embedding, every layer's attention and feed-forward, the LM head, then
       the root (norms and AttnRes mixes), over all ranks, ignoring the expert parameters EP already placed.
    3. Balancing: each router's `gather` is set so QB (solved in the training forward) concatenates the
       required-bias matrix over ranks, and `model.update_balancers()` is rebound so loss-free balancing
       all-reduces the loads: every rank computes identical router biases.

Layouts: EP = 1 (plain FSDP: experts sharded by FSDP like every other weight) or EP = world size
(every rank is a data-parallel rank and an EP rank). Gradient scale: FSDP averages the non-expert
gradients over the ranks; an expert's gradient arrives as the sum of every rank's contribution through
the all-to-all backward, so it is scaled by 1/world to match (the global loss is the mean of the ranks'
local mean losses, with equal local batches).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from k3.distributed.balanced import balanced_plan
from k3.distributed.dispatcher import DispatchStats, dispatch_compute_combine, home_plan
from k3.distributed.launch import all_gather_cat, all_reduce_sum, get_world_size
from k3.layers.moe import LatentMoE, Routing

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallelMoE(LatentMoE):
    """LatentMoE with its routed experts spread over EP ranks (made by `parallelize`, never constructed).

    w1/w3/w2 are DTensors [E, ...] sharded on dim 0 over the EP mesh; this rank computes with its local
    block [E/R, ...] plus, in balanced mode, the replicas the plan places here."""

    ep_mesh: DeviceMesh
    balanced: bool
    grad_scale: float
    last_dispatch: DispatchStats | None

    def routed(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed path over EP ranks: [T, D] -> [T, D] (T local tokens)."""
        h_TL = self.routed_expert_down_proj(x_TD) if self.latent else x_TD
        w1, w3, w2 = (_ScaleGrad.apply(getattr(self, name).to_local(), self.grad_scale) for name in EXPERT_WEIGHTS)
        plan_fn = balanced_plan if self.balanced else home_plan
        y_TKL, self.last_dispatch = dispatch_compute_combine(
            h_TL, routing.topk_ids_TK, plan_fn, w1, w3, w2, self.act, self.betas, self.ep_mesh.get_group())
        # Deterministic combine: a weighted sum over the K slots of each token in fixed order, in fp32.
        out_TL = (y_TKL.float() * routing.topk_weights_TK.float().unsqueeze(-1)).sum(1).to(x_TD.dtype)
        if self.latent:
            if self.routed_expert_norm is not None:
                out_TL = self.routed_expert_norm(out_TL)
            return self.routed_expert_up_proj(out_TL)
        return out_TL


@dataclass
class ParallelLayout:
    world_size: int
    ep_size: int
    fsdp: bool
    balanced: bool
    mesh: DeviceMesh | None


def _moe_modules(model: nn.Module) -> list[LatentMoE]:
    return [m for m in model.modules() if isinstance(m, LatentMoE)]


def _apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, balanced: bool) -> set[nn.Parameter]:
    ep_size = mesh.size()
    placed: set[nn.Parameter] = set()
    for moe in _moe_modules(model):
        num_experts = moe.w1.shape[0]
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over EP={ep_size} ranks; "
                             f"choose an EP size that divides {num_experts}")
        for name in EXPERT_WEIGHTS:
            # Rank 0's weights are scattered, so every rank starts from the same experts.
            sharded = nn.Parameter(distribute_tensor(getattr(moe, name).detach(), mesh, [Shard(0)]))
            setattr(moe, name, sharded)
            placed.add(sharded)
        moe.__class__ = ExpertParallelMoE
        moe.ep_mesh = mesh
        moe.balanced = balanced
        moe.grad_scale = 1.0 / mesh.size()
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


def _wire_balancers(model: nn.Module) -> None:
    """Every rank aggregates the same statistics, so biases stay identical: QB solves its bias inside the
    training forward from the required-bias matrix gathered over ranks; the loss-free update sums loads."""
    for _, router in model.routers():
        router.gather = all_gather_cat
    single_device = type(model).update_balancers
    model.update_balancers = functools.partial(single_device, model, all_reduce=all_reduce_sum)


def parallelize(model: nn.Module, ep_size: int = 1, fsdp: bool = True, balanced: bool = False) -> nn.Module:
    """Shard `model` (a K3ForCausalLM already on this rank's device, created with the same seed on every rank)
    over all ranks in place and return it.

    ep_size: 1 (no EP) or the world size. fsdp: shard the non-expert weights with FSDP2 (required when
    more than one rank: it is what keeps their gradients in sync). balanced: MoonEP-style balanced dispatch."""
    world = get_world_size()
    if ep_size not in (1, world):
        raise ValueError(f"--ep {ep_size} with {world} ranks is not supported; use --ep 1 (FSDP only) or "
                         f"--ep {world} (experts over every rank)")
    if world > 1 and not fsdp:
        raise ValueError("with more than one rank the non-expert weights need FSDP to keep gradients in sync; "
                         "use fsdp=True")
    if balanced and ep_size == 1:
        raise ValueError("balanced dispatch needs expert parallelism; use ep_size > 1 or balanced=False")
    layout = ParallelLayout(world, ep_size, fsdp, balanced, None)
    if world > 1:
        device_type = next(model.parameters()).device.type
        layout.mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
        ignored = _apply_expert_parallel(model, layout.mesh, balanced) if ep_size > 1 else set()
        for unit in _fsdp_units(model):
            fully_shard(unit, mesh=layout.mesh, ignored_params=ignored)
        fully_shard(model, mesh=layout.mesh, ignored_params=ignored)
        _wire_balancers(model)
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
