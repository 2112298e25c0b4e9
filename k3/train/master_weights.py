"""Mixed precision with fp32 master weights: the model's parameters in bf16 (forward and backward run in bf16
with no autocast casts), an fp32 copy of each held here and updated by AdamW, then rounded back into the bf16
parameter, as Megatron-LM's and torchtitan's mixed precision do.

Why: under bf16 autocast the fp32 weights are cast to bf16 again in every forward and backward, and the step
reads and writes fp32 gradients. Measured on one H100 (`small`, 4 x 4096, graphed step): forward + backward
166.8 ms with fp32 weights under autocast against about 131 ms with bf16 weights (BENCHMARKS.md, Training).

The masters are what a checkpoint saves under the parameters' names (k3.train.trainer), so a checkpoint is the
same fp32 state dict whichever mode wrote it, and a resumed run continues from the exact fp32 values.

The step (K3_MASTER_ADAMW, k3.kernels): `triton` reads each bf16 gradient in one pass that updates the master and
both moments and writes the bf16 parameter (k3.ops.master_adamw), clipped by a coefficient from the gradients'
fp32 norm; `torch` copies the gradients into fp32 ones, clips those, runs the optimizer of
k3.train.optim.build_optimizer over the masters and copies them back. `auto`: triton where it runs (CUDA). Both
keep the same optimizer state (the inner AdamW's), so either resumes from the other's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from k3 import kernels
from k3.ops.master_adamw import MultiTensorTables, fused_available, master_adamw_step
from k3.train.optim import build_optimizer_for

MASTER_ADAMW = "master_adamw"  # the kernel switch (K3_MASTER_ADAMW)

# --master-weights choices. fp32-autocast: fp32 parameters updated in place, the forward under bf16 autocast (the
# --dtype setting as it is); bf16-params: this module.
MASTER_WEIGHTS = ("auto", "fp32-autocast", "bf16-params")


class MasterWeightAdamW:
    """AdamW (k3.train.optim.build_optimizer's groups and implementation) on fp32 masters of `model`'s
    parameters, which this casts to `dtype` in place at construction (their fp32 values become the masters).

    Per step: clip_grad_norm_(max_norm) (the parameters' gradients' global L2 norm in fp32, returned; the step
    takes the gradients scaled as torch.nn.utils.clip_grad_norm_ would), then step() updates the masters from the
    gradients and rounds them into the parameters. take_grads() instead hands over fp32 copies of the gradients
    (the masters' .grad) for a caller to clip itself; step() then takes those. param_groups, state_dict and
    load_state_dict are the inner AdamW's, laid out as build_optimizer's on the model would be.

    fused: the one-pass step (k3.ops.master_adamw), chosen by K3_MASTER_ADAMW at construction unless given."""

    def __init__(self, model: nn.Module, lr: float, weight_decay: float, dtype: torch.dtype = torch.bfloat16,
                 fused: bool | None = None) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        with torch.no_grad():
            for p in self.params:
                p.data = p.data.to(dtype)
        self.inner = build_optimizer_for(zip(self.names, self.masters), lr, weight_decay)
        device = self.masters[0].device if self.masters else torch.device("cpu")
        self.fused = fused_choice(device) if fused is None else fused
        self.master_grads: list[torch.Tensor] | None = None  # take_grads' fp32 buffers, made at its first call
        self.grad_scale: torch.Tensor | None = None  # clip_grad_norm_'s coefficient for the next fused step
        self.taken = False  # take_grads ran since the last step
        self.fused_stepped = 0  # tensors the last fused step sent through the kernel (the rest: its twin)
        self._tables: dict[int, MultiTensorTables] = {}  # per param group, kept between fused steps
        self._param_of = {id(m): p for p, m in zip(self.params, self.masters)}

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def triton_stepped(self) -> int:
        return getattr(self.inner, "triton_stepped", 0)

    @torch.no_grad()
    def take_grads(self) -> list[torch.Tensor]:
        """The parameters' gradients copied into the masters' fp32 gradients (a parameter without one leaves its
        master without one, so AdamW skips it); returns the masters, whose gradients the caller may clip."""
        if self.master_grads is None:
            self.master_grads = [torch.zeros_like(m) for m in self.masters]
        sources, targets = [], []
        for p, master, grad in zip(self.params, self.masters, self.master_grads):
            master.grad = None if p.grad is None else grad
            if p.grad is not None:
                sources.append(p.grad)
                targets.append(grad)
        if targets:
            torch._foreach_copy_(targets, sources)
        self.taken = True
        return self.masters

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of the parameters' gradients, computed in fp32 (as of fp32 copies of them), with the
        gradients the next step() takes scaled by torch.nn.utils.clip_grad_norm_'s coefficient
        min(1, max_norm / (norm + 1e-6)). On the torch path: clip_grad_norm_ of take_grads()."""
        if not self.fused:
            return torch.nn.utils.clip_grad_norm_(self.take_grads(), max_norm)
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        self.grad_scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step of the masters, rounded into the parameters: the fused pass, or after take_grads (which
        this runs if the caller did not) the inner optimizer's step and a copy."""
        if self.fused and not self.taken:
            self._fused_step()
        else:
            if not self.taken:
                self.take_grads()
            self.inner.step()
            torch._foreach_copy_(self.params, self.masters)
            for m in self.masters:
                m.grad = None
        self.taken, self.grad_scale = False, None

    def _fused_step(self) -> None:
        self.fused_stepped = 0
        for index, group in enumerate(self.inner.param_groups):
            _check_fused_group(group)
            lists = ([], [], [], [], [], [])  # params, grads, masters, exp_avgs, exp_avg_sqs, steps
            for master in group["params"]:
                param = self._param_of[id(master)]
                if param.grad is None:
                    continue
                state = self.inner.state[master]
                if not state:
                    _init_state(state, master, group)
                for target, t in zip(lists, (param, param.grad, master, state["exp_avg"], state["exp_avg_sq"],
                                             state["step"])):
                    target.append(t)
            if not lists[0]:
                continue
            torch._foreach_add_(lists[5], 1)
            beta1, beta2 = group["betas"]
            tables = self._tables.setdefault(index, MultiTensorTables())
            self.fused_stepped += master_adamw_step(*lists, group["lr"], beta1, beta2, group["eps"],
                                                    group["weight_decay"], maximize=group["maximize"],
                                                    grad_scale=self.grad_scale, tables=tables)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def named_masters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return zip(self.names, self.masters)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """model.state_dict() with every trained parameter's fp32 master in place of its bf16 value (a tied
        parameter under each of its names): what a checkpoint saves."""
        by_param = {id(p): m for p, m in zip(self.params, self.masters)}
        return {name: (by_param[id(t)].detach() if id(t) in by_param else t.detach())
                for name, t in model.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load_masters(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """The masters from a checkpoint's model state (fp32 values under the parameters' names), and the
        parameters rounded from them, as after a step."""
        by_param = {id(p): m for p, m in zip(self.params, self.masters)}
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in by_param:
                by_param[id(t)].copy_(state_dict[name])
        torch._foreach_copy_(self.params, self.masters)


def fused_choice(device: torch.device) -> bool:
    """Whether K3_MASTER_ADAMW picks the one-pass step for masters on `device`: auto on CUDA with triton."""
    choice = kernels.choice(MASTER_ADAMW)
    if choice == "triton" and not fused_available(device):
        raise ValueError(f"K3_MASTER_ADAMW=triton, but the kernel cannot run on {device} (it needs triton on CUDA, "
                         "or TRITON_INTERPRET=1 on the CPU); use K3_MASTER_ADAMW=torch")
    return choice == "triton" or (choice == "auto" and device.type == "cuda" and fused_available(device))


def _check_fused_group(group: dict) -> None:
    beta1, beta2 = group["betas"]
    scalars = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
    if group["amsgrad"] or not group["decoupled_weight_decay"] or any(isinstance(x, torch.Tensor) for x in scalars):
        raise ValueError("the fused master-weight step takes AdamW with float options and no amsgrad; this group has "
                         "amsgrad, coupled weight decay or a tensor option (use K3_MASTER_ADAMW=torch)")


def _init_state(state: dict, master: torch.Tensor, group: dict) -> None:
    """The state torch's AdamW makes at a parameter's first step (step count on the device when fused or
    capturable, as torch keeps it), so that state_dict and a later torch step see the same layout."""
    on_device = group["fused"] or group["capturable"]
    state["step"] = (torch.zeros((), dtype=torch.float32, device=master.device) if on_device
                     else torch.tensor(0.0, dtype=torch.float32))
    state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
