"""Process-group setup for torchrun (NCCL on GPUs, gloo on CPU) and small rank helpers.

`torchrun --nproc-per-node N -m k3 train ... --ep P` (P divides N: N/P EP groups of P ranks) sets RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; `init_distributed()` reads them. Without them the process is a
world of one and nothing is initialised.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: single process, no process group


def init_distributed(backend: str | None = None, device: str | None = None) -> DistEnv:
    """Join the process group torchrun describes in the environment (idempotent).

    backend: "nccl", "gloo" or None (NCCL when CUDA is available and device is not "cpu", else gloo).
    device: "cuda" or "cpu"; None picks CUDA when available. Each rank uses cuda:LOCAL_RANK."""
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but CUDA is not available; use device='cpu' (gloo)")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    target = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, target, dist.get_backend())
    if world_size == 1 and "RANK" not in os.environ:
        return DistEnv(0, 1, 0, target, None)
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world_size} but {missing} are not set; launch with "
                           "`torchrun --nproc-per-node N ...`, which sets them")
    chosen = backend or ("nccl" if use_cuda else "gloo")
    if chosen not in ("nccl", "gloo"):
        raise ValueError(f"backend {chosen!r} is not supported; use 'nccl' (GPU) or 'gloo' (CPU)")
    dist.init_process_group(chosen, device_id=target if chosen == "nccl" else None)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, target, chosen)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """True on rank 0 (and in a single process): the rank that prints and writes files."""
    return get_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Run the block on rank 0 first, then on the other ranks: shared files (tokenizer, tokenized data) are
    written once and found by the others."""
    if is_distributed() and not is_main():
        dist.barrier()
    yield
    if is_distributed() and is_main():
        dist.barrier()


def shutdown() -> None:
    """Leave together: a rank that tears its process group down while a peer is still busy (saving, say) can
    make gloo abort ("terminate called without an active exception"), so every rank waits at a barrier first."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


def all_gather_cat(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate each rank's x [n_r, ...] along dim 0 in rank order (n_r may differ between ranks)."""
    if not is_distributed():
        return x
    world = dist.get_world_size(group)
    size = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes_list = [int(s) for s in sizes]
    longest = max(sizes_list)
    padded = x.new_zeros((longest,) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:n] for g, n in zip(gathered, sizes_list)])


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum x over ranks in place (and return it)."""
    if is_distributed():
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_reduce_op(x: torch.Tensor, op: str, group=None) -> torch.Tensor:
    """Reduce x over ranks in place with op "sum", "min" or "max" (and return it)."""
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
    if is_distributed():
        dist.all_reduce(x, op=ops[op], group=group)
    return x


def shard_batch(batch: torch.Tensor, rank: int | None = None, world_size: int | None = None) -> torch.Tensor:
    """Rows [rank*B/W, (rank+1)*B/W) of a global batch [B, ...]: the ranks' shards concatenate to the batch."""
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    if batch.shape[0] % world_size:
        raise ValueError(f"global batch of {batch.shape[0]} rows does not split over {world_size} ranks; "
                         f"use a batch size divisible by {world_size}")
    rows = batch.shape[0] // world_size
    return batch[rank * rows:(rank + 1) * rows]
