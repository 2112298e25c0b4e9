"""Projectors from merged vision tokens [M, kh*kw*D] to the text width [M, text_hidden_size].

- "patchmerger" (Kimi-K2.5): LayerNorm over each of the kh*kw patches (eps projector_eps), Linear -> GELU ->
  Linear, with biases. Published names mm_projector.pre_norm, mm_projector.proj.0, mm_projector.proj.2.
- "patchmergerv2" (K3): Linear -> exact GELU -> Linear without biases, then RMSNorm over the text width.
  Published names mm_projector.proj.0, mm_projector.proj.2, mm_projector.post_norm.
transformers' kimi_k25 uses nn.GELU() (exact erf) in the projector and the tanh form in the tower's MLP; so do we.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.vision.config import VisionConfig
from k3.vision.tower import activation


class _Activation(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation(self.name, x)


class Projector(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        width = config.merged_width
        v2 = config.projector == "patchmergerv2"
        if not v2:
            self.pre_norm = nn.LayerNorm(config.hidden_size, eps=config.projector_eps)
        # An nn.Sequential so that the published indices proj.0 / proj.2 are the module names.
        self.proj = nn.Sequential(nn.Linear(width, width, bias=not v2), _Activation(config.projector_act),
                                  nn.Linear(width, config.text_hidden_size, bias=not v2))
        if v2:
            self.post_norm = nn.RMSNorm(config.text_hidden_size, eps=config.projector_eps)

    def forward(self, merged_MK: torch.Tensor) -> torch.Tensor:
        """[M, kh*kw*D] -> [M, text_hidden_size]"""
        if hasattr(self, "pre_norm"):
            per_patch = merged_MK.unflatten(-1, (self.config.merge_area, self.config.hidden_size))
            merged_MK = self.pre_norm(per_patch).flatten(-2)
        out = self.proj(merged_MK)
        return self.post_norm(out) if hasattr(self, "post_norm") else out
