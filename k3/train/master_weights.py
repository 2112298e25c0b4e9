"""Mixed precision with fp32 master weights: the model's parameters in bf16 (forward and backward run in bf16
with no autocast casts), an fp32 copy of each held here and updated by AdamW, then rounded back into the bf16
parameter, as Megatron-LM's and torchtitan's mixed precision do.

Why: under bf16 autocast the fp32 weights are cast to bf16 again in every forward and backward, and the step
reads and writes fp32 gradients. Measured on one H100 (`small`, 4 x 4096, graphed step): forward + backward
166.8 ms with fp32 weights under autocast against about 131 ms with bf16 weights (BENCHMARKS.md, Training).

The masters are what a checkpoint saves under the parameters' names (k3.train.trainer), so a checkpoint is the
same fp32 state dict whichever mode wrote it, and a resumed run continues from the exact fp32 values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from k3.train.optim import build_optimizer_for

# --master-weights choices. fp32-autocast: fp32 parameters updated in place, the forward under bf16 autocast (the
# --dtype setting as it is); bf16-params: this module.
MASTER_WEIGHTS = ("auto", "fp32-autocast", "bf16-params")


class MasterWeightAdamW:
    """AdamW (k3.train.optim.build_optimizer's groups and implementation) on fp32 masters of `model`'s
    parameters, which this casts to `dtype` in place at construction (their fp32 values become the masters).

    Per step: take_grads() copies the parameters' gradients into the masters' fp32 ones and returns the masters
    (clip those), step() updates the masters and copies them, rounded, into the parameters. param_groups,
    state_dict and load_state_dict are the inner AdamW's, laid out as build_optimizer's on the model would be."""

    def __init__(self, model: nn.Module, lr: float, weight_decay: float, dtype: torch.dtype = torch.bfloat16) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.master_grads = [torch.zeros_like(m) for m in self.masters]
        with torch.no_grad():
            for p in self.params:
                p.data = p.data.to(dtype)
        self.inner = build_optimizer_for(zip(self.names, self.masters), lr, weight_decay)

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
        sources, targets = [], []
        for p, master, grad in zip(self.params, self.masters, self.master_grads):
            master.grad = None if p.grad is None else grad
            if p.grad is not None:
                sources.append(p.grad)
                targets.append(grad)
        if targets:
            torch._foreach_copy_(targets, sources)
        return self.masters

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step of the masters (after take_grads), rounded into the parameters."""
        self.inner.step()
        torch._foreach_copy_(self.params, self.masters)

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
