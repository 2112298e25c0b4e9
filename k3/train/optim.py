"""AdamW with linear warmup then cosine decay to a floor."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95),
                    eps: float = 1e-8) -> torch.optim.AdamW:
    """Weight decay only on matrices (2-D and up): norms' gains, biases, decay and AttnRes gains stay undecayed,
    since shrinking them towards zero changes what the layer computes rather than regularising it."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and "embed_tokens" not in name else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused_pays(decay + no_decay) or None)


def fused_pays(params: list[torch.Tensor]) -> bool:
    """PyTorch's fused AdamW (one kernel over all parameters a step) for plain CUDA tensors; the default
    (foreach) otherwise: CPU, and sharded (DTensor) parameters, whose meshes may differ under expert
    parallelism. On one H200 the foreach step of `small`'s fp32 weights took 38 ms of kernel time a step
    (`k3 train --profile`; BENCHMARKS.md, round ten); bench/train.py has always timed the fused one."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(p.is_cuda and p.is_floating_point() and not isinstance(p, DTensor) for p in params)


def lr_at(step: int, max_steps: int, peak_lr: float, warmup_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup over `warmup_steps`, then cosine from
    peak_lr down to peak_lr * min_lr_ratio at max_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = peak_lr * min_lr_ratio
    return floor + (peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
