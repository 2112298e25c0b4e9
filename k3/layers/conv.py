"""Depthwise causal short convolution (kernel 4) with SiLU, as used on KDA's q, k and v.

Supports three things a plain nn.Conv1d does not:
- a cached tail of the last (kernel-1) inputs, so decoding one token equals the full forward;
- packed variable-length input: taps never reach across a document boundary;
- returning the new tail for the cache.
The op itself is k3.ops.short_conv (fla's fused kernel on CUDA, a PyTorch twin elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.short_conv import short_conv


class ShortConv(nn.Conv1d):
    """Weight [C, 1, W] (named like published checkpoints: `q_conv1d.weight`)."""

    def __init__(self, channels: int, kernel_size: int = 4) -> None:
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None,  # type: ignore[override]
                position_in_doc: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C]; tail [B, W-1, C] (the previous inputs) or None for zeros; packed input (B = 1) gives
        position_in_doc [T] (0 at each document start) and/or cu_seqlens [N+1].
        Returns (silu(conv(x)) [B, T, C], new tail [B, W-1, C])."""
        return short_conv(x, self.weight.squeeze(1), tail, cu_seqlens=cu_seqlens, position_in_doc=position_in_doc)
