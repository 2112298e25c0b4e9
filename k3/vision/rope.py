"""2D rotary position embedding of the MoonViT tower, in the published (complex-pair) layout.

Each head's q/k vector is read as head_dim/2 adjacent pairs (x[2j], x[2j+1]), each rotated by an angle:
pair j = 2i   rotates by  col * theta^(-4i/head_dim)   (the width coordinate sits at the even pair slots),
pair j = 2i+1 rotates by  row * theta^(-4i/head_dim)   (the height coordinate at the odd ones),
for i in [0, head_dim/4). Checked against transformers' kimi_k25, which stores q/k rows permuted into
rotate-half order (its PermuteForRope on load) and builds its angles as [w f0, h f0, w f1, h f1, ...];
in the checkpoint's own row order that is exactly the layout above. Video frames repeat their frame's grid:
time enters through an additive sincos term (k3.vision.tower), not through the rotation.
"""

from __future__ import annotations

import torch


def rope_2d_angles(grid_thw: torch.Tensor, head_dim: int, theta: float = 10000.0,
                   device: torch.device | None = None) -> torch.Tensor:
    """Angles [sum(t*h*w), head_dim/2] (fp32) for every patch, in the patch order of the processor
    (per image: frame, then row, then column)."""
    if head_dim % 4:
        raise ValueError(f"2D rotary needs head_dim divisible by 4, got {head_dim}")
    device = device if device is not None else grid_thw.device
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32) / head_dim)
    parts = []
    cache: dict[tuple[int, int], torch.Tensor] = {}
    for t, h, w in grid_thw.tolist():
        key = (int(h), int(w))
        if key not in cache:
            rows = torch.arange(h, device=device, dtype=torch.float32)
            cols = torch.arange(w, device=device, dtype=torch.float32)
            col_angles = torch.outer(cols, inv_freq)[None, :, :].expand(h, w, -1)  # [h, w, head_dim/4]
            row_angles = torch.outer(rows, inv_freq)[:, None, :].expand(h, w, -1)
            cache[key] = torch.stack([col_angles, row_angles], dim=-1).reshape(h * w, head_dim // 2)
        parts.append(cache[key].repeat(int(t), 1))
    return torch.cat(parts) if parts else torch.zeros(0, head_dim // 2, device=device)


def rope_2d_cis(angles: torch.Tensor) -> torch.Tensor:
    """Unit complex numbers e^(i angle) [N, head_dim/2] (complex64): computed once per forward, used by every layer."""
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope_2d(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [N, H, head_dim] by cis [N, head_dim/2] (rope_2d_cis); computed in fp32 as one
    complex product (x[2j] + i x[2j+1]) * e^(i angle_j), returned in x's dtype."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())  # [N, H, head_dim/2]
    return torch.view_as_real(pairs * cis[:, None, :]).flatten(-2).to(x.dtype)
