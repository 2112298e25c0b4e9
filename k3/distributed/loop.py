"""A minimal data-parallel + EP training loop: the reference the parity tests and the benchmark use.

Every rank takes its shard of the same global batch (`shard_batch`), so the sequence of global batches, and
with a fixed seed the losses, are the same for any number of ranks.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from k3.distributed.launch import all_reduce_sum, get_world_size, shard_batch


def global_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over ranks (the global loss when local batches are equal)."""
    total = all_reduce_sum(value.detach().clone().reshape(1))
    return float(total) / get_world_size()


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
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if update_balancers:
            model.update_balancers()
        losses.append(float(loss.detach()) if local else global_mean(loss))
    return losses
