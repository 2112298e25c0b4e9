"""Depthwise causal short convolution (kernel 4) with SiLU, as used on KDA's q, k and v.

Supports three things a plain nn.Conv1d does not:
- a cached tail of the last (kernel-1) inputs, so decoding one token equals the full forward;
- packed variable-length input: taps never reach across a document boundary;
- returning the new tail for the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Conv1d):
    """Weight [C, 1, W] (named like published checkpoints: `q_conv1d.weight`)."""

    def __init__(self, channels: int, kernel_size: int = 4) -> None:
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None,  # type: ignore[override]
                position_in_doc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C]; tail [B, W-1, C] (the previous inputs) or None for zeros;
        position_in_doc [T] (0 at each document start) for packed input.
        Returns (silu(conv(x)) [B, T, C], new tail [B, W-1, C])."""
        batch, length, channels = x.shape
        width = self.kernel_size[0]
        if tail is None:
            tail = x.new_zeros(batch, width - 1, channels)
        full = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, W-1+T, C]
        weight = self.weight.squeeze(1).to(x.dtype)  # [C, W]
        if position_in_doc is None:
            y = F.conv1d(full.transpose(1, 2), self.weight.to(x.dtype), groups=channels).transpose(1, 2)
        else:
            # Tap j (looking j steps back) is valid only when the token is at least j into its document.
            y = x * weight[:, width - 1]
            for j in range(1, width):
                shifted = full[:, width - 1 - j: width - 1 - j + length]
                valid = (position_in_doc >= j).to(x.dtype).view(1, length, 1)
                y = y + shifted * valid * weight[:, width - 1 - j]
        new_tail = full[:, -(width - 1):] if width > 1 else full[:, :0]
        return F.silu(y), new_tail
