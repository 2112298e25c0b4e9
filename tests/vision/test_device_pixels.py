"""Images travel as uint8 patches and are normalised on the device: the tower gets the bits the host-normalised
fp32 pixel_values gave it (CPU, fp32), and what is not a pack of uint8 patches is refused before the tower."""

import numpy as np
import pytest
import torch

from k3.vision.processing import ImageProcessor, ProcessedImages, normalise
from vision_helpers import tiny_vision

Image = pytest.importorskip("PIL.Image")
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def noise_image(width: int, height: int, seed: int):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def host_pixel_values(patches: torch.Tensor, processor: ImageProcessor) -> torch.Tensor:
    """What the processor returned before: (x / 255 - mean) / std in fp32 on the host."""
    return (patches.float() / 255.0 - processor.mean) / processor.std


def tower_inputs(vision, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the patch convolution received, the embeddings)."""
    seen = []
    hook = vision.vision_tower.patch_embed.proj.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    try:
        out = vision(pixel_values, grid_thw)
    finally:
        hook.remove()
    return seen[0], out


@pytest.mark.parametrize("mean,std", [((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), (CLIP_MEAN, CLIP_STD)])
def test_the_tower_gets_the_bits_of_host_normalised_pixel_values(mean, std):
    processor = ImageProcessor(mean=mean, std=std, max_patches=64)
    batch = processor([noise_image(56, 28, 0), noise_image(70, 90, 1), noise_image(30, 20, 2)])
    assert batch.patches.dtype == torch.uint8
    vision = tiny_vision()
    old = host_pixel_values(batch.patches, processor)
    want_input, want = tower_inputs(vision, old, batch.grid_thw)
    for pixel_values in (batch.pixel_values_on("cpu"), processor.pixel_values_on(batch.patches, "cpu"),
                         batch.pixel_values):
        got_input, got = tower_inputs(vision, pixel_values, batch.grid_thw)
        assert got_input.dtype == torch.float32 and torch.equal(got_input, want_input)
        assert torch.equal(got, want)


def test_normalising_in_the_towers_dtype_casts_the_fp32_bits():
    processor = ImageProcessor()
    batch = processor([noise_image(56, 56, 3)])
    got = batch.pixel_values_on("cpu", torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, host_pixel_values(batch.patches, processor).to(torch.bfloat16))


def test_a_batch_carries_a_quarter_of_the_fp32_bytes():
    batch = ImageProcessor()([noise_image(84, 56, 4), noise_image(28, 28, 5)])
    assert batch.patches.dtype == torch.uint8 and batch.patches.shape == (6 * 4 + 2 * 2, 3, 14, 14)
    assert 4 * batch.patches.nbytes == batch.pixel_values.nbytes


def test_normalise_is_one_function_for_processor_and_module():
    processor = ImageProcessor(mean=CLIP_MEAN, std=CLIP_STD)
    patches = torch.randint(0, 256, (5, 3, 14, 14), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(processor.normalise(patches), normalise(patches, CLIP_MEAN, CLIP_STD))
    assert torch.equal(normalise(patches), (patches.float() / 255 - 0.5) / 0.5)


def test_float_patches_are_refused_before_they_move():
    with pytest.raises(ValueError, match="must be uint8 pixels 0..255.*got torch.float32"):
        ImageProcessor().pixel_values_on(torch.rand(4, 3, 14, 14), "cpu")


def test_channels_last_patches_are_refused():
    with pytest.raises(ValueError, match=r"\[patches, 3, 14, 14\] \(channels first\), got shape \(4, 14, 14, 3\)"):
        ImageProcessor().pixel_values_on(torch.zeros(4, 14, 14, 3, dtype=torch.uint8), "cpu")


def test_patches_of_another_size_are_refused():
    with pytest.raises(ValueError, match=r"must be \[patches, 3, 14, 14\].*got shape \(4, 3, 16, 16\)"):
        ImageProcessor().pixel_values_on(torch.zeros(4, 3, 16, 16, dtype=torch.uint8), "cpu")


def test_processed_images_refuse_float_patches():
    with pytest.raises(ValueError, match="must be uint8"):
        ProcessedImages(torch.zeros(4, 3, 14, 14), torch.tensor([[1, 2, 2]]), [1])


def test_the_tower_refuses_patches_not_normalised():
    batch = ImageProcessor()([noise_image(28, 28, 6)])
    with pytest.raises(ValueError, match="pixel_values must be normalised floats, got torch.uint8"):
        tiny_vision()(batch.patches, batch.grid_thw)
