"""`k3 rl` under torchrun: data-parallel RL over the ranks of one torch.distributed job, as `k3 train` runs.

    torchrun --nproc-per-node 2 -m k3 rl --run DIR --suite calc --out OUT ...      (gloo on CPU, NCCL on GPUs)

Every rank holds the whole policy (the engine samples from a full model, so its weights are not sharded),
its own inference engine and its own sandboxes. A step's tasks are dealt round-robin over the ranks (task i to
rank i mod W); each rank runs its groups, computes their advantages (a group never spans ranks) and
backpropagates its own sequences with their share of the global batch's loss; the gradients are summed over
the ranks (k3.rl.policy.PolicyUpdater), so every rank takes the optimizer step one process would take over the
whole batch and the replicas stay equal. Rank 0 writes metrics, plots and checkpoints; episode metrics and
parked partial rollouts are gathered to it. Without torchrun this is a world of one and nothing changes.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class Ranks:
    """This process's place in the job: rank, world size, and the few collectives the RL loop needs."""

    def __init__(self, device: str = "auto") -> None:
        self.env = None
        self.rank, self.world = 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from k3.distributed.launch import init_distributed

            self.env = init_distributed(device=None if device == "auto" else device)
            self.rank, self.world = self.env.rank, self.env.world_size

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device | None:
        """This rank's device under torchrun (cuda:LOCAL_RANK or cpu); None in a single process."""
        return self.env.device if self.env is not None else None

    def share(self, items: list[T]) -> tuple[list[T], list[int]]:
        """This rank's items (i mod world == rank) and their indices in ``items``."""
        indices = list(range(self.rank, len(items), self.world))
        return [items[i] for i in indices], indices

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a list of one in a single process)."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is true on some rank."""
        if self.world == 1:
            return flag
        from k3.distributed.launch import all_reduce_op

        return bool(all_reduce_op(torch.tensor([int(flag)], device=self.device), "max").item())

    def barrier(self) -> None:
        if self.world > 1:
            from k3.distributed.launch import barrier

            barrier()

    def shutdown(self) -> None:
        if self.world > 1:
            from k3.distributed.launch import shutdown

            shutdown()
            self.world = 1


def merge_parked(states: list[dict]) -> dict:
    """Every rank's RolloutRunner.parked_state as one: the groups with the rank that held each."""
    return {"groups": [g for s in states for g in s["groups"]],
            "ranks": [rank for rank, s in enumerate(states) for _ in s["groups"]],
            "world": len(states), "snapshots": {k: v for s in states for k, v in s["snapshots"].items()}}


def parked_share(state: dict | None, rank: int, world: int) -> dict | None:
    """This rank's part of a saved parked state: the groups it held when the world is the same size,
    else every world-th group."""
    if not state or not state.get("groups"):
        return state
    if state.get("world", 1) == world and "ranks" in state:
        groups = [g for g, r in zip(state["groups"], state["ranks"]) if r == rank]
    else:
        groups = state["groups"][rank::world]
    names = {e["parked_snapshot"] for g in groups for e in g if e.get("parked_snapshot")}
    return {"groups": groups, "snapshots": {k: v for k, v in state["snapshots"].items() if k in names}}
