"""GLU feed-forward blocks with the two activations K3-family models use (the activation: k3.ops.glu)."""

from __future__ import annotations

import torch
from torch import nn

from k3.config import ModelConfig
from k3.layers.fused_weights import Group, fused, linear_group
from k3.ops.glu import glu_activation
from k3.ops.linear_triton import project
from k3.ops.shared_input_linear import joins_projections, linears_of_one_input


class GLUMLP(nn.Module):
    """down(act(gate(x), up(x))); used for the dense layers and the shared experts."""

    def __init__(self, config: ModelConfig, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = config.hidden_act
        self.betas = (config.situ_beta_gate, config.situ_beta_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = fused(self, "gate_up")  # one GEMM when fused at load (k3.layers.fused_weights)
        if group is not None:
            gate, up = linear_group(x, group)
        elif joins_projections(x, (self.gate_proj, self.up_proj)):
            gate, up = linears_of_one_input(x, [self.gate_proj.weight, self.up_proj.weight])
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return project(self.down_proj, glu_activation(gate, up, self.act, *self.betas))

    def fusable_groups(self) -> list[Group]:
        """Gate and up as one GEMM (k3.layers.fused_weights)."""
        return [("mlp", "gate_up", [(self.gate_proj, "weight"), (self.up_proj, "weight")], 0)]
