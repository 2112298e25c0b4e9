"""Small configs and random inputs shared by the vision tests."""

from __future__ import annotations

import torch

from k3.vision import VisionConfig, VisionModel

# K3's switches (RMSNorm, no biases, bilinear grid, patchmergerv2, QKV width != width) at test size.
K3_TINY = dict(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, head_dim=24,
               pos_emb_height=8, pos_emb_width=8, text_hidden_size=64)
# Kimi-K2.5's switches (LayerNorm, biases, bicubic grid, patchmerger) at test size.
K25_TINY = dict(K3_TINY, head_dim=16, norm_type="layernorm", norm_eps=1e-5, attn_bias=True, mlp_bias=True,
                patch_bias=True, pos_emb_interpolation="bicubic", projector="patchmerger")


def randomize(model: torch.nn.Module, scale: float = 0.2) -> torch.nn.Module:
    """Every parameter random (norm weights around 1), so no tensor can hide behind a zero or one init."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in name and name.endswith("weight") and p.dim() == 1
            p.copy_((1.0 if is_norm else 0.0) + scale * torch.randn_like(p))
    return model


def tiny_vision(variant: dict = K3_TINY, **overrides) -> VisionModel:
    return randomize(VisionModel(VisionConfig(**{**variant, **overrides}))).eval()


def random_pixels(grid: list[list[int]], patch: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grid)
    return torch.randn(int(grid_thw.prod(-1).sum()), 3, patch, patch), grid_thw


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
