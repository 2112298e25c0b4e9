"""A minimal data-parallel + EP training loop: the reference the parity tests and the benchmark use; and
gradient clipping over a parallelized model's meshes.

Every rank takes its shard of the same global batch (`shard_batch`), so the sequence of global batches, and
with a fixed seed the losses, are the same for any number of ranks.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from k3.distributed.launch import all_reduce_sum, get_world_size, shard_batch


def global_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over ranks (the global loss when local batches are equal)."""
    total = all_reduce_sum(value.detach().clone().reshape(1))
    return float(total) / get_world_size()


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (L2) for a parallelized model: scales the gradients so their global
    norm (the single-device model's) is at most `max_norm` and returns that norm, a plain tensor equal on
    every rank. Collective when some gradients are DTensors.

    torch's version cannot mix DTensors of different meshes, and a model with EP holds two: the non-expert
    FSDP shards live on the mesh of all ranks, the expert stacks on their EP group's mesh. Each mesh's norm is
    completed on that mesh (the expert replicas in other EP groups hold the same gradients), then combined."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    by_mesh: dict = {}
    for grad in grads:
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    squares = []
    for mesh, group in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(group)
        squares.append((norm.full_tensor() if mesh is not None else norm).double().square())
    total = torch.stack(squares).sum().sqrt()
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    if scale < 1.0:
        with torch.no_grad():
            for grad in grads:
                grad.mul_(scale)
    return total


def train_steps(model: nn.Module, batches: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer,
                update_balancers: bool = True, local: bool = False) -> list[float]:
    """One optimizer step per global batch [B, T+1] of token ids (inputs ids[:, :-1], labels ids[:, 1:]).
    Returns the global loss of every step (identical on every rank).

    local=True: this rank alone trains a model that is not parallelized, on whole batches, without any
    collective (a single-device baseline inside a distributed job)."""
    device = next(model.parameters()).device
    losses = []
    model.train()
    for global_ids in batches:
        ids = (global_ids if local else shard_batch(global_ids)).to(device)
        loss = model(ids[:, :-1], labels=ids[:, 1:], return_logits=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if update_balancers:
            model.update_balancers()
        losses.append(float(loss.detach()) if local else global_mean(loss))
    return losses
