"""K3ForConditionalGeneration: image embeddings land at the placeholder positions; several images per sequence
and per batch; cached generation (prefill with images, then plain decode steps, or chunked prefill from
inputs_embeds) equals the full forward; training reaches the vision weights."""

from __future__ import annotations

import pytest
import torch

from k3.config import ModelConfig
from k3.multimodal import K3ForConditionalGeneration
from k3.vision import VisionConfig
from vision_helpers import K3_TINY, randomize, random_pixels

MEDIA = 255


def tiny_multimodal() -> K3ForConditionalGeneration:
    model = K3ForConditionalGeneration(ModelConfig.from_preset("debug"), VisionConfig(**K3_TINY), MEDIA)
    randomize(model.vision)
    return model.eval()


def sequence(parts: list) -> list[int]:
    """ints are text tokens; ('img', n) is n placeholders."""
    out: list[int] = []
    for part in parts:
        out.extend([MEDIA] * part[1] if isinstance(part, tuple) else [part])
    return out


def test_image_rows_replace_exactly_the_placeholders_in_reading_order():
    model = tiny_multimodal()
    pixels, grid_thw = random_pixels([[1, 4, 4], [1, 2, 6], [2, 4, 2]])  # 4, 3 and 2 tokens
    rows = [sequence([1, 2, ("img", 4), 3, ("img", 3), 4]), sequence([5, ("img", 2), 6, 7, 8, 9, 10, 11, 12, 13])]
    ids = torch.tensor(rows)
    with torch.no_grad():
        embeds = model.embed_multimodal(ids, pixels, grid_thw)
        images = model.vision(pixels, grid_thw)
        text = model.language_model.model.embed_tokens(ids)
    mask = ids == MEDIA
    torch.testing.assert_close(embeds[mask], images)  # row 0's two images, then row 1's
    torch.testing.assert_close(embeds[~mask], text[~mask])


def test_placeholder_count_must_match_the_images():
    model = tiny_multimodal()
    pixels, grid_thw = random_pixels([[1, 4, 4]])  # 4 tokens
    with pytest.raises(ValueError, match="3 media placeholder token.*4 embedding"):
        model(torch.tensor([sequence([1, ("img", 3), 2])]), pixels, grid_thw)
    with pytest.raises(ValueError, match="2 media placeholder token.*0 embedding"):
        model(torch.tensor([sequence([1, ("img", 2)])]))


def test_cached_generation_equals_the_full_forward():
    torch.manual_seed(1)
    model = tiny_multimodal()
    pixels, grid_thw = random_pixels([[1, 4, 4], [1, 2, 2]])  # 4 + 1 tokens
    ids = torch.tensor([sequence([1, 2, ("img", 4), 3, ("img", 1), 4, 5, 6, 7, 8, 9])])
    with torch.no_grad():
        full = model(ids, pixels, grid_thw).logits
        prefill = 9  # every placeholder inside the prefill
        cache = model.new_cache(1)
        steps = [model(ids[:, :prefill], pixels, grid_thw, cache=cache).logits]
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], cache=cache).logits)
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)

        # An engine with chunked prefill embeds once and feeds slices, cutting through an image.
        embeds = model.embed_multimodal(ids, pixels, grid_thw)
        cache = model.new_cache(1)
        chunks = [model.language_model(None, cache, inputs_embeds=embeds[:, a:b]).logits
                  for a, b in ((0, 4), (4, 11), (11, ids.shape[1]))]
        torch.testing.assert_close(torch.cat(chunks, 1), full, rtol=1e-4, atol=1e-4)


def test_images_change_the_logits_after_them_only():
    model = tiny_multimodal()
    ids = torch.tensor([sequence([1, 2, 3, ("img", 4), 4, 5])])
    (a, grid), (b, _) = random_pixels([[1, 4, 4]]), random_pixels([[1, 4, 4]])
    with torch.no_grad():
        first, second = model(ids, a, grid).logits, model(ids, b, grid).logits
    torch.testing.assert_close(first[:, :3], second[:, :3])  # causal: text before the image is untouched
    assert (first[:, 3:] - second[:, 3:]).abs().max() > 1e-4


def test_training_step_reaches_the_vision_weights():
    model = tiny_multimodal().train()
    pixels, grid_thw = random_pixels([[1, 4, 4], [2, 2, 2]])
    ids = torch.tensor([sequence([1, ("img", 4), 2, 3, ("img", 1), 4, 5])])
    labels = ids.masked_fill(ids == MEDIA, -100)  # placeholders are not text to predict
    out = model(ids, pixels, grid_thw, labels=labels)
    out.loss.backward()
    for name in ("vision.vision_tower.patch_embed.proj.weight", "vision.vision_tower.encoder.blocks.0.wqkv.weight",
                 "vision.mm_projector.proj.0.weight", "language_model.model.embed_tokens.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_widths_and_media_token_are_checked():
    with pytest.raises(ValueError, match="text_hidden_size"):
        K3ForConditionalGeneration(ModelConfig.from_preset("debug"), VisionConfig(**{**K3_TINY,
                                                                                   "text_hidden_size": 32}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        K3ForConditionalGeneration(ModelConfig.from_preset("debug"), VisionConfig(**K3_TINY), media_token_id=256)
