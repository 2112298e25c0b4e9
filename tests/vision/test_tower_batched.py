"""The tower's pack-wide host-indexed paths (rotary angles, position grid, 2x2 merge) against the per-image
formulas they replace: the same values, the same gradients, for packs of mixed sizes, video clips and repeats."""

from __future__ import annotations

import pytest
import torch

from k3.vision.attention import cu_seqlens_from_grid, packed_attention
from k3.vision.rope import rope_2d_angles
from k3.vision.tower import merge_patches
from vision_helpers import random_pixels, tiny_vision

PACKS = {
    "one image": [[1, 4, 6]],
    "mixed sizes with repeats": [[1, 4, 4], [1, 8, 8], [1, 2, 6], [1, 4, 4], [1, 6, 2], [1, 8, 8]],
    "clips among images": [[1, 4, 4], [3, 2, 4], [1, 6, 6], [2, 4, 4]],
}


def per_image_angles(grid_thw: torch.Tensor, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)
    parts = []
    for t, h, w in grid_thw.tolist():
        col = torch.outer(torch.arange(w, dtype=torch.float32), inv_freq)[None].expand(h, w, -1)
        row = torch.outer(torch.arange(h, dtype=torch.float32), inv_freq)[:, None].expand(h, w, -1)
        parts.append(torch.stack([col, row], dim=-1).reshape(h * w, head_dim // 2).repeat(t, 1))
    return torch.cat(parts)


def per_image_positions(grid, x: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    parts = []
    for t, h, w in grid_thw.tolist():
        spatial = grid.resized(h, w)
        parts.append(spatial if t == 1 else (spatial[None] + grid.time_weight[:t, None, :]).flatten(0, 1))
    return x + torch.cat(parts)


def per_image_merge(x: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    outputs, offset = [], 0
    for t, h, w in grid_thw.tolist():
        clip = x[offset: offset + t * h * w].view(t, h // 2, 2, w // 2, 2, -1)
        outputs.append(clip.permute(0, 1, 3, 2, 4, 5).mean(0).reshape((h // 2) * (w // 2), -1))
        offset += t * h * w
    return torch.cat(outputs)


@pytest.mark.parametrize("pack", PACKS)
def test_rotary_angles_equal_the_per_image_outer_products(pack):
    grid_thw = torch.tensor(PACKS[pack])
    assert torch.equal(rope_2d_angles(grid_thw, head_dim=48), per_image_angles(grid_thw, 48))


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("pack", PACKS)
def test_position_grid_gather_equals_per_image_resizes_with_gradients(pack, mode):
    grid = tiny_vision(pos_emb_interpolation=mode).vision_tower.patch_embed.pos_emb
    grid_thw = torch.tensor(PACKS[pack])
    torch.manual_seed(0)
    x = torch.randn(int(grid_thw.prod(-1).sum()), grid.weight.shape[-1])
    upstream = torch.randn_like(x)
    outputs, grads = [], []
    for positions in (grid(x, grid_thw), per_image_positions(grid, x, grid_thw)):
        grid.weight.grad = None
        (positions * upstream).sum().backward()
        outputs.append(positions.detach())
        grads.append(grid.weight.grad.clone())
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)  # sums over images in another order


@pytest.mark.parametrize("pack", PACKS)
def test_merge_gather_equals_per_image_blocks_with_gradients(pack):
    grid_thw = torch.tensor(PACKS[pack])
    torch.manual_seed(0)
    x = torch.randn(int(grid_thw.prod(-1).sum()), 5, requires_grad=True)
    fast, oracle = merge_patches(x, grid_thw, (2, 2)), per_image_merge(x, grid_thw)
    assert torch.equal(fast, oracle)
    upstream = torch.randn_like(fast)
    (fast_grad,) = torch.autograd.grad((fast * upstream).sum(), x)
    (oracle_grad,) = torch.autograd.grad((oracle * upstream).sum(), x)
    assert torch.equal(fast_grad, oracle_grad)


def test_host_bounds_give_the_same_attention_as_the_device_read():
    grid_thw = torch.tensor(PACKS["mixed sizes with repeats"])
    cu = cu_seqlens_from_grid(grid_thw)
    q, k, v = torch.randn(3, int(cu[-1]), 2, 8).unbind(0)
    assert torch.equal(packed_attention(q, k, v, cu, "sdpa", cu.tolist()), packed_attention(q, k, v, cu, "sdpa"))


@pytest.mark.parametrize("pack", PACKS)
def test_tower_output_and_gradients_do_not_depend_on_how_the_pack_is_grouped(pack):
    """The whole pack in one call equals each image alone (outputs and summed gradients): the gathers keep
    every image's rows to itself. In fp64, so that sums taken in another order agree to ~1e-12."""
    vision = tiny_vision().train().double()
    pixels, grid_thw = random_pixels(PACKS[pack])
    pixels = pixels.double()
    tokens = sum((h // 2) * (w // 2) for _, h, w in PACKS[pack])
    upstream = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    packed = vision(pixels, grid_thw)
    (packed * upstream).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in vision.named_parameters()}
    vision.zero_grad()
    alone, offset, row = [], 0, 0
    for t, h, w in PACKS[pack]:
        out = vision(pixels[offset: offset + t * h * w], torch.tensor([[t, h, w]]))
        (out * upstream[row: row + out.shape[0]]).sum().backward()
        alone.append(out.detach())
        offset, row = offset + t * h * w, row + out.shape[0]
    torch.testing.assert_close(packed.detach(), torch.cat(alone), rtol=1e-10, atol=1e-12)
    for name, param in vision.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-9, atol=1e-11, msg=name)
