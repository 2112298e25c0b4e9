"""MoonViT3d: the vision tower of K3 and Kimi-K2.5 (SPEC §10).

    pixel_values [N, 3, p, p]   N = sum over images of t*h*w patches, per image in (frame, row, column) order
    -> Conv2d (kernel = stride = p) -> [N, D]
    + the learned [64, 64, D] position grid resized to each image's (h, w) (bilinear for K3, bicubic for K2.5)
    + for video clips (t > 1) a fixed sincos row per frame
    -> num_layers pre-norm blocks: norm0, wqkv, 2D rotary on q/k, bidirectional attention within each image
       (all frames of a clip together), wo, residual; norm1, fc0, GELU (tanh), fc1, residual
    -> final norm -> 2x2 merge with mean over frames -> [sum h*w/4, 4D]

Module names are the published checkpoint's (`vision_tower.` + patch_embed.proj, patch_embed.pos_emb,
encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}, encoder.final_layernorm), so a state dict loads as is.
Shape legend: N packed patches, D tower width, H heads, Dh head dim, M merged tokens.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from k3.vision.attention import packed_attention
from k3.vision.config import VisionConfig
from k3.vision.rope import apply_rope_2d, rope_2d_angles, rope_2d_cis


def make_norm(config: VisionConfig, dim: int) -> nn.Module:
    if config.norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps if config.norm_eps is not None else 1e-5)
    return nn.RMSNorm(dim, eps=config.norm_eps)  # eps None: the input dtype's epsilon, as the public tower


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def check_grid(grid_thw: torch.Tensor, config: VisionConfig, num_patches: int | None = None) -> None:
    """Clear errors for a grid the tower cannot take."""
    if grid_thw.dim() != 2 or grid_thw.shape[-1] != 3:
        raise ValueError(f"grid_thw must be [num_images, 3] (frames, rows, columns of patches), got shape "
                         f"{tuple(grid_thw.shape)}")
    kh, kw = config.merge_kernel
    for i, (t, h, w) in enumerate(grid_thw.tolist()):
        if min(t, h, w) < 1:
            raise ValueError(f"image {i}: grid {t}x{h}x{w} has an empty side; every image needs t, h, w >= 1")
        if h % kh or w % kw:
            raise ValueError(f"image {i}: patch grid {h}x{w} is not divisible by the merge kernel {kh}x{kw}; "
                             f"resize images to multiples of patch_size * merge ({config.patch_size * kh} px)")
        if t > config.pos_emb_time:
            raise ValueError(f"image {i}: {t} frames but the tower's time table has {config.pos_emb_time}; "
                             f"split the video into clips of at most {config.pos_emb_time} frames")
    total = int(grid_thw.prod(-1).sum())
    if num_patches is not None and total != num_patches:
        raise ValueError(f"grid_thw describes {total} patches but pixel_values holds {num_patches}")


def sincos_table(length: int, dim: int) -> torch.Tensor:
    """[length, dim] fixed time rows: cat(sin(t * w_i), cos(t * w_i)), w_i = 10000^(-i / (dim/2))."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    angles = torch.outer(torch.arange(length, dtype=torch.float64), omega)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class PositionGrid(nn.Module):
    """Learned [H0, W0, D] grid resized to each image's patch grid, plus a sincos row per frame of a clip."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.mode = config.pos_emb_interpolation
        self.weight = nn.Parameter(torch.zeros(config.pos_emb_height, config.pos_emb_width, config.hidden_size))
        self.register_buffer("time_weight", sincos_table(config.pos_emb_time, config.hidden_size), persistent=False)

    def resized(self, h: int, w: int) -> torch.Tensor:
        """[h*w, D] grid for an h x w image (the stored grid itself when the sizes agree)."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        grid = self.weight.permute(2, 0, 1).unsqueeze(0)  # [1, D, H0, W0]
        out = F.interpolate(grid, size=(h, w), mode=self.mode, align_corners=False)
        return out.squeeze(0).permute(1, 2, 0).flatten(0, 1)

    def forward(self, x: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]) -> torch.Tensor:
        """x [N, D] + each patch's row of its image's resized grid (and its frame's time row in a clip): one resize
        per distinct image size, then one gather over the pack (no per-image tensor ops)."""
        grids = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
        offsets: dict[tuple[int, int], int] = {}  # (h, w) -> first row of its resized grid in the table
        tables, index, frames, rows = [], [], [], 0
        for t, h, w in grids:
            if (h, w) not in offsets:  # images of one size share one resize
                offsets[(h, w)] = rows
                tables.append(self.resized(h, w))
                rows += h * w
            index.append(np.tile(np.arange(offsets[(h, w)], offsets[(h, w)] + h * w), t))
            # time row f + 1 for frame f of a clip; row 0 (zeros) for single images, which add none
            frames.append(np.repeat(np.arange(1, t + 1) if t > 1 else np.zeros(1, np.int64), h * w))
        if not grids:
            return x
        table = tables[0] if len(tables) == 1 else torch.cat(tables)
        index_N = torch.from_numpy(np.concatenate(index)).to(x.device, non_blocking=True)
        position = table.index_select(0, index_N)
        if any(t > 1 for t, _, _ in grids):
            time_table = torch.cat([self.time_weight.new_zeros(1, self.time_weight.shape[1]), self.time_weight])
            frame_N = torch.from_numpy(np.concatenate(frames)).to(x.device, non_blocking=True)
            position = position + time_table.index_select(0, frame_N).to(position.dtype)
        return x + position.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(config.in_channels, config.hidden_size, kernel_size=p, stride=p, bias=config.patch_bias)
        self.pos_emb = PositionGrid(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]) -> torch.Tensor:
        x_ND = self.proj(pixel_values).flatten(1)
        return self.pos_emb(x_ND, grid_thw)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.act = config.hidden_act
        self.fc0 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.fc1 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(activation(self.act, self.fc0(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.norm0 = make_norm(config, config.hidden_size)
        self.norm1 = make_norm(config, config.hidden_size)
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.qkv_width, bias=config.attn_bias)
        self.wo = nn.Linear(config.qkv_width, config.hidden_size, bias=config.attn_bias)
        self.mlp = VisionMLP(config)

    def attention(self, x_ND: torch.Tensor, cu_seqlens: torch.Tensor, cis: torch.Tensor,
                  backend: str, bounds: list[int] | None = None) -> torch.Tensor:
        qkv = self.wqkv(x_ND).unflatten(-1, (3, self.num_heads, self.head_dim))  # [N, 3, H, Dh]
        q, k, v = qkv.unbind(1)
        q, k = apply_rope_2d(q, cis), apply_rope_2d(k, cis)
        out_NHD = packed_attention(q, k, v, cu_seqlens, backend, bounds)
        return self.wo(out_NHD.flatten(1))

    def forward(self, x_ND: torch.Tensor, cu_seqlens: torch.Tensor, cis: torch.Tensor,
                backend: str = "auto", bounds: list[int] | None = None) -> torch.Tensor:
        """cis [N, Dh/2]: the rotary factors of every patch (rope_2d_cis); bounds: cu_seqlens as Python ints."""
        x_ND = x_ND + self.attention(self.norm0(x_ND), cu_seqlens, cis, backend, bounds)
        return x_ND + self.mlp(self.norm1(x_ND))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.final_layernorm = make_norm(config, config.hidden_size)

    def forward(self, x_ND: torch.Tensor, grid_thw: torch.Tensor | list[list[int]],
                backend: str = "auto") -> torch.Tensor:
        grids = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
        cis = rope_2d_cis(rope_2d_angles(grids, self.config.head_dim, self.config.rope_theta, device=x_ND.device))
        # the image bounds once per forward, as host ints and as one device tensor, for every layer
        bounds = np.concatenate([[0], np.cumsum([t * h * w for t, h, w in grids], dtype=np.int64)]).tolist()
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32).to(x_ND.device, non_blocking=True)
        for block in self.blocks:
            x_ND = block(x_ND, cu_seqlens, cis, backend, bounds)
        return self.final_layernorm(x_ND)


def merge_patches(x_ND: torch.Tensor, grid_thw: torch.Tensor | list[list[int]],
                  kernel: tuple[int, int]) -> torch.Tensor:
    """sd2_tpool: [N, D] -> [M, kh*kw*D]; each merged token holds a kh x kw block of patches (row-major inside
    the block), averaged over the clip's frames. Images stay in order, merged tokens row-major within each.
    A pack of single images (t = 1, the mean is the patch itself) is one gather in merged order."""
    kh, kw = kernel
    dim = x_ND.shape[-1]
    grids = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    if grids and all(t == 1 for t, _, _ in grids):
        order, offset = [], 0
        for _, h, w in grids:
            order.append(offset + _merge_order(h, w, kh, kw))
            offset += h * w
        order_N = torch.from_numpy(np.concatenate(order)).to(x_ND.device, non_blocking=True)
        return x_ND.index_select(0, order_N).view(-1, kh * kw * dim)
    outputs, offset = [], 0
    for t, h, w in grids:
        clip = x_ND[offset: offset + t * h * w].view(t, h // kh, kh, w // kw, kw, dim)
        merged = clip.permute(0, 1, 3, 2, 4, 5).mean(dim=0)  # [h/kh, w/kw, kh, kw, D]
        outputs.append(merged.reshape((h // kh) * (w // kw), kh * kw * dim))
        offset += t * h * w
    return torch.cat(outputs) if outputs else x_ND.new_zeros(0, kh * kw * dim)


@functools.lru_cache(maxsize=256)
def _merge_order(h: int, w: int, kh: int, kw: int) -> np.ndarray:
    """Row-major patch indices of an h x w image in merged order: block by block, row-major inside each block."""
    return np.arange(h * w).reshape(h // kh, kh, w // kw, kw).transpose(0, 2, 1, 3).reshape(-1)


class MoonViT3d(nn.Module):
    """tower(pixel_values [N, C, p, p], grid_thw [n, 3]) -> merged patch features [M, kh*kw*D]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = VisionEncoder(config)
        # "auto" | "sdpa" | "varlen": see k3.vision.attention
        self.attention_backend = "auto"

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        c, p = self.config.in_channels, self.config.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c, p, p):
            raise ValueError(f"pixel_values must be [patches, {c}, {p}, {p}] (k3.vision.ImageProcessor makes "
                             f"them), got shape {tuple(pixel_values.shape)}")
        if not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values must be normalised floats, got {pixel_values.dtype}: normalise uint8 "
                             f"patches first (ImageProcessor.pixel_values_on or k3.vision.processing.normalise)")
        # sizes drive host-side index building: read once (give grid_thw on the CPU: a device one costs a sync)
        grid_thw = grid_thw.to("cpu", torch.long)
        check_grid(grid_thw, self.config, pixel_values.shape[0])
        grids = grid_thw.tolist()
        weight = self.patch_embed.proj.weight
        x_ND = self.patch_embed(pixel_values.to(weight.device, weight.dtype), grids)
        x_ND = self.encoder(x_ND, grids, self.attention_backend)
        return merge_patches(x_ND, grids, self.config.merge_kernel)
