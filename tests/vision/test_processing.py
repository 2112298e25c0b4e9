"""Image processing: sizes within the patch budget, patch order, normalisation, video clips, placeholders, and
one test per kind of bad input (each a clear error or the documented conversion)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

Image = pytest.importorskip("PIL.Image")

from k3.vision import VisionConfig  # noqa: E402
from k3.vision.processing import (  # noqa: E402
    ImageProcessor,
    expand_placeholders,
    open_image,
    target_size,
    to_rgb,
)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def noise_image(width: int, height: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), mode="RGB")


@pytest.mark.parametrize("height,width", [(28, 28), (30, 500), (1000, 1000), (7000, 300), (5, 3), (4000, 6000)])
def test_target_size_stays_within_budget_and_never_upscales(height, width):
    (new_h, new_w), (pad_h, pad_w) = target_size(height, width, 14, 2, max_patches=1024, max_side_patches=64)
    assert new_h <= height and new_w <= width  # never upscaled
    assert pad_h % 28 == 0 and pad_w % 28 == 0 and pad_h - new_h < 28 and pad_w - new_w < 28
    assert new_h <= 64 * 14 and new_w <= 64 * 14
    # The budget binds the resized image; padding adds at most one merge row and column (as transformers does).
    assert (new_h // 14) * (new_w // 14) <= 1024


def test_patches_are_the_normalised_crops_in_row_major_order():
    image = noise_image(56, 84)  # 84 rows x 56 columns: no resize, no padding
    batch = ImageProcessor()([image])
    assert batch.grid_thw.tolist() == [[1, 6, 4]] and batch.tokens_per_image == [6]
    pixels = (torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    row, col = 4, 3
    expected = pixels[:, row * 14:(row + 1) * 14, col * 14:(col + 1) * 14]
    torch.testing.assert_close(batch.pixel_values[row * 4 + col], expected)


def test_normalise_gives_the_bits_of_the_formula_and_leaves_its_input_alone():
    processor = ImageProcessor(mean=(0.48, 0.5, 0.41), std=(0.27, 0.5, 0.26))
    every_value = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).repeat(2, 3, 1, 1)
    kept = every_value.clone()
    formula = (every_value.float() / 255.0 - processor.mean) / processor.std
    assert torch.equal(processor.normalise(every_value), formula)
    assert torch.equal(every_value, kept)  # the in-place steps work on a copy


def test_normalise_refuses_values_already_normalised():
    with pytest.raises(ValueError, match="uint8 pixels 0..255, got torch.float32"):
        ImageProcessor().normalise(torch.zeros(2, 3, 14, 14))


def test_padding_is_black_bottom_right():
    batch = ImageProcessor()([Image.new("RGB", (30, 20), (255, 255, 255))])
    assert batch.grid_thw.tolist() == [[1, 2, 4]]  # 20x30 px padded to 28x56
    image = batch.pixel_values.view(2, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 56)
    assert torch.all(image[:, :20, :30] == 1.0) and torch.all(image[:, 20:, :] == -1.0)
    assert torch.all(image[:, :, 30:] == -1.0)


def test_several_images_keep_their_order():
    images = [noise_image(56, 28, 1), noise_image(28, 84, 2), noise_image(112, 56, 3)]
    batch = ImageProcessor()(images)
    assert batch.grid_thw.tolist() == [[1, 2, 4], [1, 6, 2], [1, 4, 8]]
    assert batch.tokens_per_image == [2, 3, 8]
    single = ImageProcessor()([images[1]])
    torch.testing.assert_close(batch.pixel_values[8:20], single.pixel_values)


def test_video_frames_become_clips_of_at_most_pos_emb_time_frames():
    frames = [noise_image(56, 56, seed) for seed in range(6)]
    processor = ImageProcessor.for_vision(VisionConfig(pos_emb_time=4))
    batch = processor.preprocess_video(frames)
    assert batch.grid_thw.tolist() == [[4, 4, 4], [2, 4, 4]]
    assert batch.tokens_per_image == [4, 4]  # temporal pooling: a clip costs one frame's tokens
    assert batch.pixel_values.shape[0] == 6 * 16
    frame_5 = ImageProcessor()([frames[5]]).pixel_values
    torch.testing.assert_close(batch.pixel_values[-16:], frame_5)


def test_video_frames_of_mixed_sizes_are_refused():
    with pytest.raises(ValueError, match="different sizes"):
        ImageProcessor().preprocess_video([noise_image(56, 56), noise_image(28, 56)])


def test_huge_image_is_resized_into_the_budget():
    image = Image.new("RGB", (5000, 3000), (10, 20, 30))
    batch = ImageProcessor(max_patches=4096, max_side_patches=128)([image])
    _, h, w = batch.grid_thw[0].tolist()
    assert w <= 128 and (h - 2) * (w - 2) <= 4096
    assert batch.pixel_values.shape[0] == h * w


def test_decompression_bomb_is_refused_before_decoding():
    data = png_bytes(Image.new("L", (400, 300)))
    with pytest.raises(ValueError, match="over the limit"):
        open_image(data, max_input_pixels=100_000)


def test_not_an_image_and_truncated_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not a readable image"):
        open_image(b"this is not an image")
    data = png_bytes(noise_image(64, 64))
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        open_image(truncated)
    with pytest.raises(FileNotFoundError):
        open_image(tmp_path / "missing.png")


def test_zero_size_image_is_refused():
    with pytest.raises(ValueError, match="at least one pixel"):
        ImageProcessor()([Image.new("RGB", (0, 10))])


def test_alpha_is_composited_over_white():
    rgba = Image.new("RGBA", (28, 28), (255, 0, 0, 0))  # fully transparent red
    rgba.putpixel((0, 0), (255, 0, 0, 255))
    rgb = np.asarray(to_rgb(rgba))
    assert tuple(rgb[0, 0]) == (255, 0, 0) and tuple(rgb[5, 5]) == (255, 255, 255)
    for mode in ("LA", "PA"):
        assert to_rgb(rgba.convert(mode)).mode == "RGB"


def test_cmyk_and_16_bit_greyscale_are_converted():
    cmyk = Image.new("CMYK", (28, 28), (0, 255, 255, 0))  # red in CMYK
    assert tuple(np.asarray(to_rgb(cmyk))[0, 0]) == (255, 0, 0)
    wide = Image.fromarray(np.full((28, 28), 65535, dtype=np.uint16))
    assert wide.mode.startswith("I;16")
    assert tuple(np.asarray(to_rgb(wide))[0, 0]) == (255, 255, 255)
    half = Image.fromarray(np.full((28, 28), 257 * 100, dtype=np.uint16))
    assert tuple(np.asarray(to_rgb(half))[0, 0]) == (100, 100, 100)


def test_unsupported_mode_is_a_clear_error():
    class Odd:
        mode = "BGR;24"
        info: dict = {}

    with pytest.raises(ValueError, match="not supported"):
        to_rgb(Odd())


def test_data_url_and_bytes_give_the_same_pixels():
    data = png_bytes(noise_image(56, 28))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    a, b = ImageProcessor()([url]), ImageProcessor()([data])
    torch.testing.assert_close(a.pixel_values, b.pixel_values)
    with pytest.raises(ValueError, match="base64"):
        open_image("data:image/png;base64,@@@")


def test_placeholders_expand_per_image_and_counts_must_agree():
    media = 9
    assert expand_placeholders([1, media, 2, media, 3], [2, 3], media) == [1, 9, 9, 2, 9, 9, 9, 3]
    with pytest.raises(ValueError, match="2 media placeholder"):
        expand_placeholders([media, media], [4], media)
    with pytest.raises(ValueError, match="0 media placeholder"):
        expand_placeholders([1, 2], [4], media)
