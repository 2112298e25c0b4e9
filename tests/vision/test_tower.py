"""The MoonViT tower on its own: rotary geometry, isolation per image, video time rows and temporal pooling,
the position grid, gradients, and the errors for grids it cannot take."""

from __future__ import annotations

import pytest
import torch

from k3.vision import VisionConfig, VisionModel
from k3.vision.rope import apply_rope_2d, rope_2d_angles, rope_2d_cis
from k3.vision.tower import merge_patches, sincos_table
from vision_helpers import K3_TINY, K25_TINY, random_pixels, rel_err, tiny_vision


def test_rotary_width_at_even_pairs_height_at_odd_pairs():
    angles = rope_2d_angles(torch.tensor([[1, 3, 5]]), head_dim=16).view(3, 5, 8)  # [rows, cols, pairs]
    assert torch.all(angles[:, :, 0::2] == angles[:1, :, 0::2])  # even pairs ignore the row
    assert torch.all(angles[:, :, 1::2] == angles[:, :1, 1::2])  # odd pairs ignore the column
    inv_freq = 10000.0 ** (-torch.arange(0, 16, 4).float() / 16)
    torch.testing.assert_close(angles[2, 4, 0::2], 4 * inv_freq)
    torch.testing.assert_close(angles[2, 4, 1::2], 2 * inv_freq)


def test_rotary_rotates_adjacent_pairs():
    angles = torch.rand(5, 4) * 6
    x = torch.randn(5, 3, 8)
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    expected = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    torch.testing.assert_close(apply_rope_2d(x, rope_2d_cis(angles)), expected)


def test_rotary_scores_depend_only_on_the_2d_offset():
    grid = torch.tensor([[1, 6, 6]])
    cis = rope_2d_cis(rope_2d_angles(grid, head_dim=16)).view(6, 6, 8)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(a, b):  # query at patch a, key at patch b
        return float((apply_rope_2d(q, cis[a][None]) * apply_rope_2d(k, cis[b][None])).sum())

    assert score((1, 2), (3, 1)) == pytest.approx(score((2, 4), (4, 3)), rel=1e-5)
    assert score((1, 2), (3, 1)) != pytest.approx(score((1, 2), (1, 3)), rel=1e-3)


@pytest.mark.parametrize("variant", [K3_TINY, K25_TINY], ids=["k3", "kimi-k2.5"])
def test_packed_images_equal_each_image_alone(variant):
    vision = tiny_vision(variant)
    grids = [[1, 4, 6], [2, 2, 4], [1, 8, 2]]
    pixels, grid_thw = random_pixels(grids)
    with torch.no_grad():
        packed = vision(pixels, grid_thw)
        alone, start = [], 0
        for grid in grids:
            n = grid[0] * grid[1] * grid[2]
            alone.append(vision(pixels[start:start + n], torch.tensor([grid])))
            start += n
    assert rel_err(packed, torch.cat(alone)) < 1e-6


def test_video_adds_one_time_row_per_frame_and_pools_frames():
    vision = tiny_vision()
    frame, _ = random_pixels([[1, 4, 4]])
    clip = frame.repeat(3, 1, 1, 1)  # three identical frames
    with torch.no_grad():
        still = vision(frame, torch.tensor([[1, 4, 4]]))
        video = vision(clip, torch.tensor([[3, 4, 4]]))
    assert video.shape == still.shape == (4, 64)  # a clip costs one frame's tokens
    assert rel_err(video, still) > 1e-3  # the time rows made the frames differ
    table = sincos_table(4, 8)
    torch.testing.assert_close(table[0], torch.tensor([0, 0, 0, 0, 1, 1, 1, 1.0]))
    torch.testing.assert_close(table[2, :4], torch.sin(2 * 10000.0 ** (-torch.arange(4) / 4.0)))


def test_merge_takes_row_major_2x2_blocks_and_averages_frames():
    t, h, w, d = 2, 4, 6, 3
    x = torch.randn(t * h * w, d)
    merged = merge_patches(x, torch.tensor([[t, h, w]]), (2, 2))
    frames = x.view(t, h, w, d)
    token = 1 * (w // 2) + 2  # merged row 1, merged column 2
    block = frames[:, 2:4, 4:6, :].mean(0).reshape(4 * d)  # patches (2,4) (2,5) (3,4) (3,5)
    torch.testing.assert_close(merged[token], block)


def test_position_grid_is_used_as_is_at_its_own_size_and_resized_otherwise():
    for mode in ("bilinear", "bicubic"):
        grid = tiny_vision(pos_emb_interpolation=mode).vision_tower.patch_embed.pos_emb
        assert torch.equal(grid.resized(8, 8), grid.weight.flatten(0, 1))
        expected = torch.nn.functional.interpolate(grid.weight.permute(2, 0, 1)[None], size=(4, 12), mode=mode,
                                                   align_corners=False)[0].permute(1, 2, 0).flatten(0, 1)
        torch.testing.assert_close(grid.resized(4, 12), expected)


def test_every_parameter_gets_a_gradient():
    vision = tiny_vision().train()
    pixels, grid_thw = random_pixels([[1, 4, 4], [2, 2, 2]])
    vision(pixels, grid_thw).square().mean().backward()
    missing = [n for n, p in vision.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or p.grad.abs().sum() == 0]
    assert not missing, f"no gradient reached {missing}"


def test_bad_grids_are_clear_errors():
    vision = tiny_vision()
    pixels, _ = random_pixels([[1, 4, 4]])
    with pytest.raises(ValueError, match="not divisible by the merge kernel"):
        vision(pixels[:15], torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match="describes 32 patches but pixel_values holds 16"):
        vision(pixels, torch.tensor([[1, 4, 8]]))
    with pytest.raises(ValueError, match="time table has 4"):
        vision(pixels.repeat(5, 1, 1, 1), torch.tensor([[5, 4, 4]]))
    with pytest.raises(ValueError, match="pixel_values must be"):
        vision(pixels[:, :, :7], torch.tensor([[1, 4, 4]]))


def test_full_size_shapes_are_the_published_ones():
    with torch.device("meta"):
        k3 = dict(VisionModel(VisionConfig.from_preset("k3")).state_dict())
        k25 = dict(VisionModel(VisionConfig.from_preset("kimi-k2.5")).state_dict())
    expected_k3 = {
        "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
        "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
        "vision_tower.encoder.blocks.26.wqkv.weight": (3 * 1536, 1024),
        "vision_tower.encoder.blocks.26.wo.weight": (1024, 1536),
        "vision_tower.encoder.blocks.0.mlp.fc0.weight": (4096, 1024),
        "vision_tower.encoder.blocks.0.norm0.weight": (1024,),
        "vision_tower.encoder.final_layernorm.weight": (1024,),
        "mm_projector.proj.0.weight": (4096, 4096),
        "mm_projector.proj.2.weight": (7168, 4096),
        "mm_projector.post_norm.weight": (7168,),
    }
    assert {n: tuple(k3[n].shape) for n in expected_k3} == expected_k3
    assert not any(n.endswith(".bias") for n in k3) and "mm_projector.pre_norm.weight" not in k3
    assert tuple(k25["mm_projector.proj.0.weight"].shape) == (4608, 4608)
    assert tuple(k25["mm_projector.pre_norm.weight"].shape) == (1152,)
    assert tuple(k25["vision_tower.encoder.blocks.0.wqkv.bias"].shape) == (3 * 1152,)
    assert "mm_projector.post_norm.weight" not in k25
