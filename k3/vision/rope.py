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

import functools

import numpy as np
import torch


def patch_coordinates(grid_thw: torch.Tensor | list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) int64 arrays [sum(t*h*w)] of every patch in the processor's order (per image: frame, then
    row, then column), built on the host from the grid's Python ints: no device work per image."""
    grids = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    rows, cols = [], []
    for t, h, w in grids:
        local_rows, local_cols = _grid_coordinates(int(t), int(h), int(w))
        rows.append(local_rows)
        cols.append(local_cols)
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(rows), np.concatenate(cols)


@functools.lru_cache(maxsize=256)
def _grid_coordinates(t: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = np.divmod(np.arange(h * w, dtype=np.int64), w)
    return np.tile(rows, t), np.tile(cols, t)


def rope_2d_angles(grid_thw: torch.Tensor | list[list[int]], head_dim: int, theta: float = 10000.0,
                   device: torch.device | None = None) -> torch.Tensor:
    """Angles [sum(t*h*w), head_dim/2] (fp32) for every patch, in the patch order of the processor
    (per image: frame, then row, then column). One set of tensor ops for the whole pack, whatever its image count:
    the coordinates come from the host (patch_coordinates), the products are those of a per-image outer()."""
    if head_dim % 4:
        raise ValueError(f"2D rotary needs head_dim divisible by 4, got {head_dim}")
    if device is None:
        device = grid_thw.device if isinstance(grid_thw, torch.Tensor) else torch.device("cpu")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32) / head_dim)
    rows, cols = patch_coordinates(grid_thw)
    # one host-to-device copy of both coordinate rows (exact in fp32: a side is far below 2^24 patches)
    coords = torch.from_numpy(np.stack([cols, rows]).astype(np.float32)).to(device, non_blocking=True)
    angles = coords[:, :, None] * inv_freq  # [2, N, head_dim/4]: columns, rows
    return torch.stack([angles[0], angles[1]], dim=-1).reshape(-1, head_dim // 2)


def rope_2d_cis(angles: torch.Tensor) -> torch.Tensor:
    """Unit complex numbers e^(i angle) [N, head_dim/2] (complex64): computed once per forward, used by every layer."""
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope_2d(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [N, H, head_dim] by cis [N, head_dim/2] (rope_2d_cis); computed in fp32 as one
    complex product (x[2j] + i x[2j+1]) * e^(i angle_j), returned in x's dtype."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())  # [N, H, head_dim/2]
    return torch.view_as_real(pairs * cis[:, None, :]).flatten(-2).to(x.dtype)
