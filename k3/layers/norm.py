"""RMSNorm modules. Statistics are taken in fp32 (or fp64 for fp64 inputs), whatever the input dtype; the math
lives in k3.ops.norm (fla's fused kernels on CUDA, PyTorch twins elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.norm import compute_dtype, rms_norm, rms_norm_gated

__all__ = ["RMSNorm", "GatedRMSNorm", "compute_dtype"]


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(RMSNorm):
    """KDA output norm: RMSNorm(x) * sigmoid(gate), per head (the last dimension is the head dim)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return rms_norm_gated(x, gate, self.weight, self.eps)
