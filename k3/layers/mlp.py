"""GLU feed-forward blocks with the two activations K3-family models use.

SiLU-GLU:  act(g, u) = silu(g) * u                                     (Kimi Linear)
SiTU-GLU:  act(g, u) = beta_g*tanh(g/beta_g)*sigmoid(g) * beta_u*tanh(u/beta_u)   (K3; betas 4 and 25)
SiTU is SiLU with both branches soft-capped by tanh, which keeps expert outputs bounded in low precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import ModelConfig
from k3.layers.fused_weights import fused, linear_group


def glu_activation(gate: torch.Tensor, up: torch.Tensor, kind: str, beta_gate: float = 4.0,
                   beta_up: float = 25.0) -> torch.Tensor:
    if kind == "silu":
        return F.silu(gate) * up
    if kind == "situ":
        return (beta_gate * torch.tanh(gate / beta_gate) * torch.sigmoid(gate)) * (beta_up * torch.tanh(up / beta_up))
    raise ValueError(f"unknown GLU activation {kind!r}; use 'silu' or 'situ'")


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
        gate, up = linear_group(x, group) if group is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(glu_activation(gate, up, self.act, *self.betas))
