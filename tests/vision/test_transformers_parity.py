"""Same weights -> same image embeddings as transformers' kimi_k25 (Kimi_K25VisionModel + its projector).

A small random transformers model is saved with its own save_pretrained, read back with
k3.checkpoint.hf_vision.load_vision, and both sides embed the same patches: square, non-square, smaller and larger than the learned grid (bicubic
resize both ways), several images in one pack, and video clips (t > 1: sincos time rows, temporal pooling).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
kimi_k25 = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")

from k3.checkpoint.hf_vision import load_vision  # noqa: E402
from k3.vision import rope as k3_rope  # noqa: E402
from vision_helpers import randomize, random_pixels, rel_err  # noqa: E402

GRIDS = {
    "square, the learned grid's own size": [[1, 8, 8]],
    "non-square, smaller than the grid": [[1, 4, 6]],
    "taller than the grid (upsampled rows)": [[1, 12, 6]],
    "several images in one pack": [[1, 10, 6], [1, 2, 2], [1, 6, 4]],
    "video clip, 3 frames": [[3, 4, 6]],
    "video clips mixed with images": [[2, 6, 4], [1, 4, 8], [4, 2, 2]],
}


@pytest.fixture(scope="module")
def saved_k25(tmp_path_factory):
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig

    torch.manual_seed(0)
    vision = Kimi_K25VisionConfig(num_attention_heads=2, num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                  pos_emb_height=8, pos_emb_width=8)
    text = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=24, intermediate_size=32,
                moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None,
                kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    config = Kimi_K25Config(vision_config=vision.to_dict(), text_config=text, projection_hidden_size=32)
    config._attn_implementation = "sdpa"
    model = kimi_k25.Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():  # randomise the vision side so that no weight hides behind its init
        randomize(model.model.vision_tower)
        randomize(model.model.mm_projector)
    path = tmp_path_factory.mktemp("kimi_k25")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("grid", list(GRIDS.values()), ids=list(GRIDS))
def test_image_embeddings_match_transformers(saved_k25, grid):
    reference_model, path = saved_k25
    vision = load_vision(path)
    assert vision.config.norm_type == "layernorm" and vision.config.projector == "patchmerger"
    pixels, grid_thw = random_pixels(grid)
    with torch.no_grad():
        try:
            reference = reference_model.model.get_image_features(pixels, grid_thw).pooler_output
        except RuntimeError as error:
            if max(t for t, _, _ in grid) == 1:
                raise
            # Seen with transformers 5.17: its own get_image_features fails on clips (t > 1); 5.24 runs them.
            pytest.skip(f"transformers {transformers.__version__} cannot embed video clips itself: {error}")
        ours = vision.image_features(pixels, grid_thw)
    assert [tuple(r.shape) for r in ours] == [tuple(r.shape) for r in reference]
    err = rel_err(torch.cat(ours), torch.cat(reference))
    assert err < 1e-5, f"relative error {err:.2e} against transformers for grid {grid}"


def test_swapped_rotary_axes_break_parity(saved_k25, monkeypatch):
    """The parity test can see the x/y order of the rotary pairs: with rows and columns swapped it fails."""
    reference_model, path = saved_k25
    vision = load_vision(path)
    pixels, grid_thw = random_pixels([[1, 4, 6]])
    original = k3_rope.rope_2d_angles

    def swapped(grid, head_dim, theta=10000.0, device=None):
        angles = original(grid, head_dim, theta, device)
        return angles.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)

    monkeypatch.setattr("k3.vision.tower.rope_2d_angles", swapped)
    with torch.no_grad():
        reference = torch.cat(reference_model.model.get_image_features(pixels, grid_thw).pooler_output)
        err = rel_err(vision(pixels, grid_thw), reference)
    assert err > 1e-2, f"swapping the rotary axes changed the output by only {err:.2e}"
