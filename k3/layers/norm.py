"""RMSNorm variants. Statistics are taken in fp32 (or fp64 for fp64 inputs), whatever the input dtype."""

from __future__ import annotations

import torch
from torch import nn


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for low-precision inputs; fp64 stays fp64 (parity tests run in double)."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(compute_dtype(x))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.to(x.dtype)).to(dtype)


class GatedRMSNorm(RMSNorm):
    """KDA output norm: RMSNorm(x) * sigmoid(gate), per head (the last dimension is the head dim)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        dtype = x.dtype
        x = x.to(compute_dtype(x))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(x.dtype)
        return (x * torch.sigmoid(gate.to(x.dtype))).to(dtype)
