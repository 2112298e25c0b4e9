"""AdamW with linear warmup then cosine decay to a floor; on CUDA, the large tensors' step through one Triton kernel
each (SplitAdamW, k3.ops.adamw_triton), picked by K3_ADAMW."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam

from k3.ops.triton_support import kernel_backend, triton_available

ADAMW_ENV = "K3_ADAMW"
# Tensors of at least this many elements take the Triton kernel, one launch each; smaller ones stay in torch's
# multi-tensor launches. In `small` that is 50 tensors and 1.55B of its 1.734B parameters: the routed experts
# (45 of 32M elements), the embedding, the LM head and the dense MLP. Measured on one H100 (bench/adamw.py
# --min-numel, `small`, bf16): 10.23 ms a step at 4M (and at 16M) against torch's fused 12.05 ms; at 1M (163
# tensors, the [1024, 1024] projections too) 11.94 ms, at 64K 13.59 ms: a kernel a small tensor costs more in
# launches and tails than torch's multi-tensor kernel, which packs many of them into one launch.
TRITON_MIN_NUMEL = 1 << 22


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95),
                    eps: float = 1e-8) -> torch.optim.AdamW:
    """Weight decay only on matrices (2-D and up): norms' gains, biases, decay and AttnRes gains stay undecayed,
    since shrinking them towards zero changes what the layer computes rather than regularising it.

    K3_ADAMW picks the implementation: auto (SplitAdamW where PyTorch's fused AdamW pays, on plain CUDA tensors
    with triton importable; torch.optim.AdamW otherwise), torch (torch.optim.AdamW) or triton (SplitAdamW
    anywhere: on the CPU its kernel runs in Triton's interpreter, TRITON_INTERPRET=1, as the tests run it)."""
    return build_optimizer_for(model.named_parameters(), lr, weight_decay, betas, eps)


def build_optimizer_for(named_parameters: Iterable[tuple[str, torch.Tensor]], lr: float, weight_decay: float,
                        betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """build_optimizer over (name, tensor) pairs: the tensors it updates may be other than the model's own
    parameters (k3.train.master_weights: fp32 masters of bf16 parameters, named as those)."""
    decay, no_decay = [], []
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and "embed_tokens" not in name else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = fused_pays(decay + no_decay)
    return adamw_class(fused)(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def adamw_class(fused: bool) -> type[torch.optim.AdamW]:
    """The AdamW that K3_ADAMW names, given whether torch's fused one would pay (fused_pays)."""
    backend = kernel_backend(ADAMW_ENV)
    if backend == "triton" and not triton_available():
        raise ValueError(f"{ADAMW_ENV}=triton, but triton is not importable; install it or use {ADAMW_ENV}=torch")
    split = backend == "triton" or (backend == "auto" and fused and triton_available())
    return SplitAdamW if split else torch.optim.AdamW


def fused_pays(params: list[torch.Tensor]) -> bool:
    """PyTorch's fused AdamW (one kernel over all parameters a step) for plain CUDA tensors; the default
    (foreach) otherwise: CPU, and sharded (DTensor) parameters, whose meshes may differ under expert
    parallelism. On one H200 the foreach step of `small`'s fp32 weights took 38 ms of kernel time a step
    (`k3 train --profile`; BENCHMARKS.md, round ten); bench/train.py has always timed the fused one."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(p.is_cuda and p.is_floating_point() and not isinstance(p, DTensor) for p in params)


class SplitAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step sends every large plain tensor (TRITON_MIN_NUMEL elements or more, contiguous,
    its step count on its device) through k3.ops.adamw_triton's kernel, one launch each, and the rest through
    torch's own path for the group's options (fused, foreach or single-tensor).

    Everything else is torch's: the constructor, param_groups (lr set there each step is read at the next step),
    state (per parameter "step", "exp_avg", "exp_avg_sq", laid out as AdamW lays them out for the same
    options), state_dict and load_state_dict; a checkpoint of either optimizer loads into the other. A group with
    amsgrad, a tensor lr or non-decoupled weight decay, and any step under a GradScaler (grad_scale / found_inf,
    which only torch's fused kernel applies), go through torch whole. differentiable=True is refused.

    min_numel: the threshold (None: TRITON_MIN_NUMEL, read at every step). After a step, triton_stepped is the
    number of tensors that it sent through the kernel."""

    def __init__(self, params: Iterable[Any], *args: Any, min_numel: int | None = None, **kwargs: Any) -> None:
        if kwargs.get("differentiable"):
            raise ValueError("SplitAdamW does not support differentiable=True (its kernel has no autograd); use "
                             "torch.optim.AdamW")
        super().__init__(params, *args, **kwargs)
        self.min_numel = min_numel
        self.triton_stepped = 0

    @torch.no_grad()
    def step(self, closure=None):
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            self.triton_stepped = 0
            return _unhooked(torch.optim.AdamW.step)(self, closure)
        # torch 2.13 names it for any accelerator; earlier releases (the GPU machines' 2.11) for CUDA only.
        health_check = (getattr(self, "_accelerator_graph_capture_health_check", None)
                        or self._cuda_graph_capture_health_check)
        health_check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        min_numel = TRITON_MIN_NUMEL if self.min_numel is None else self.min_numel
        kernel_work, torch_work = [], []
        for group in self.param_groups:
            lists = ([], [], [], [], [], [])  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
            has_complex = self._init_group(group, *lists)
            rest = _route(group, lists, min_numel, kernel_work)
            if rest[0]:
                torch_work.append((group, rest, has_complex))
        self._step_with_kernel(kernel_work)
        for group, rest, has_complex in torch_work:
            _torch_adamw(group, rest, has_complex)
        self.triton_stepped = len(kernel_work)
        return loss

    @staticmethod
    def _step_with_kernel(work: list[tuple]) -> None:
        from k3.ops.adamw_triton import launch_adamw_step

        if not work:
            return
        # The kernel reads the count of the step it takes, as torch's fused kernel does after its own increment.
        torch._foreach_add_([item[5] for item in work], 1)
        # Largest first: their GPU time covers the host's launches of the smaller ones behind them.
        for group, param, grad, exp_avg, exp_avg_sq, step in sorted(work, key=lambda item: -item[1].numel()):
            beta1, beta2 = group["betas"]
            # Checked by _route (adamw_input_problem, and _group_takes_kernel: float scalars).
            launch_adamw_step(param, grad, exp_avg, exp_avg_sq, step, group["lr"], beta1, beta2, group["eps"],
                              group["weight_decay"], maximize=group["maximize"])


def _unhooked(step):
    """A torch optimizer's step without the wrapper that runs the step hooks (Optimizer._patch_step_function puts
    it on a class's step when its first instance is built): SplitAdamW.step has its own, which has already run
    them, and calling AdamW's wrapped step from it would run every hook twice."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _group_takes_kernel(group: dict[str, Any]) -> bool:
    """Whether the kernel computes what torch would for this group's options."""
    beta1, beta2 = group["betas"]
    scalars = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
    return (not group["amsgrad"] and not group["differentiable"] and group["decoupled_weight_decay"]
            and not any(isinstance(x, torch.Tensor) for x in scalars))


def _takes_kernel(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: torch.Tensor, min_numel: int) -> bool:
    from k3.ops.adamw_triton import adamw_input_problem

    # Tensor subclasses (DTensor shards, under FSDP or expert parallelism) go through torch, which knows them.
    plain = type(param) in (torch.Tensor, nn.Parameter) and type(grad) is torch.Tensor
    return (param.numel() >= min_numel and plain
            and adamw_input_problem(param, grad, exp_avg, exp_avg_sq, step) is None)


def _route(group: dict[str, Any], lists: tuple[list, ...], min_numel: int, kernel_work: list[tuple]) -> tuple:
    """Append the group's kernel-ready tensors to kernel_work as (group, param, grad, exp_avg, exp_avg_sq, step);
    return the others as the six lists torch's adam takes (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
    steps)."""
    if not _group_takes_kernel(group):
        return lists
    params, grads, exp_avgs, exp_avg_sqs, _, steps = lists  # no max_exp_avg_sqs: amsgrad is off
    rest = ([], [], [], [], [], [])
    for item in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        if _takes_kernel(*item, min_numel):
            kernel_work.append((group, *item))
        else:
            for collected, t in zip((rest[0], rest[1], rest[2], rest[3], rest[5]), item):
                collected.append(t)
    return rest


def _torch_adamw(group: dict[str, Any], lists: tuple[list, ...], has_complex: bool) -> None:
    """torch's AdamW step of these tensors, with the arguments torch.optim.Adam.step passes for the group."""
    beta1, beta2 = group["betas"]
    adam(*lists, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
         weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"],
         capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
         grad_scale=None, found_inf=None, decoupled_weight_decay=group["decoupled_weight_decay"])


def lr_at(step: int, max_steps: int, peak_lr: float, warmup_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup over `warmup_steps`, then cosine from
    peak_lr down to peak_lr * min_lr_ratio at max_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = peak_lr * min_lr_ratio
    return floor + (peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
