"""Images (and video frames) -> uint8 patches [N, 3, p, p] + grid_thw [n, 3]; media placeholders in token ids.

    processor = ImageProcessor.for_vision(vision.config)
    batch = processor([image_a, image_b])                # PIL images, paths, bytes or data: URLs
    ids = expand_placeholders(ids, batch.tokens_per_image, media_token_id)
    pixels = batch.pixel_values_on(device, dtype)        # the uint8 patches moved, normalised on the device
    pixels = batch.pixel_values                          # or normalised on the host: fp32 [N, 3, p, p]

The uint8 patches are what travels to the device (a quarter of fp32's bytes); `normalise` is the one place that
rescales and normalises, the same elementwise ops on the host or the device (the same bits in fp32).

Resizing follows transformers' Kimi_K25ImageProcessor (navit_resize): never upscale; scale down (bicubic) until
the patch count is within `max_patches` and each side within `max_side_patches` patches; then pad on the bottom
and right with black to a multiple of patch_size * merge (28 px), rescale to [0, 1] and normalise with mean 0.5,
std 0.5 (so the padding reads -1). Patches are cut in (row, column) order, each [3, p, p].

Input conversions (documented, not errors): palette / greyscale / 1-bit / CMYK / YCbCr / LAB images become RGB;
images with alpha (RGBA, LA, PA, palette transparency) are composited over white; 16-bit greyscale (I;16) is
divided by 257 (0..65535 onto 0..255); 32-bit integer or float greyscale (I, F) is stretched from its own
min..max onto 0..255. Errors (ValueError): a file
that is not an image or is truncated, an image with a zero side, one with more than `max_input_pixels` pixels
(decompression bombs are refused before decoding), an unknown mode, a video clip with frames of mixed sizes.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3.vision.config import VisionConfig

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
DEFAULT_MAX_PATCHES = 16384  # transformers' Kimi_K25ImageProcessor.max_patches
DEFAULT_MAX_SIDE_PATCHES = 512  # its size["max_height"]: patches per side
DEFAULT_MAX_INPUT_PIXELS = 178_956_970  # PIL's own decompression-bomb limit (2 x Image.MAX_IMAGE_PIXELS)
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_PLAIN_MODES = ("1", "L", "P", "RGB", "CMYK", "YCbCr", "LAB", "HSV", "RGBX")
_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")

ImageSource = object  # a PIL.Image.Image, a path, bytes, or a 'data:image/...;base64,' URL


def _pil():
    try:
        from PIL import Image
    except ImportError as error:
        raise ImportError("image processing needs Pillow: pip install 'k3[vision]' (or pip install pillow)") \
            from error
    return Image


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:[<mime>][;base64],<payload>` URL (what OpenAI image_url parts carry)."""
    if not url.startswith("data:") or "," not in url:
        raise ValueError(f"not a data: URL (expected 'data:image/png;base64,...'), got {url[:40]!r}")
    header, payload = url[5:].split(",", 1)
    if not header.endswith(";base64"):
        raise ValueError("only base64 data: URLs are supported ('data:image/png;base64,...')")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"the data: URL's base64 payload is corrupt: {error}") from error


def open_image(source: ImageSource, max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS):
    """A decoded PIL image from a PIL image, path, bytes or data: URL; ValueError when it cannot be one."""
    Image = _pil()
    if isinstance(source, Image.Image):
        image, name = source, "image"
    else:
        if isinstance(source, (bytes, bytearray, memoryview)):
            stream, name = io.BytesIO(bytes(source)), "image bytes"
        elif isinstance(source, str) and source.startswith("data:"):
            stream, name = io.BytesIO(decode_data_url(source)), "data: URL"
        elif isinstance(source, (str, os.PathLike)):
            path = Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"image file {path} does not exist")
            stream, name = io.BytesIO(path.read_bytes()), str(path)
        else:
            raise ValueError(f"an image must be a PIL image, a path, bytes or a data: URL, got {type(source).__name__}")
        try:
            image = Image.open(stream)  # lazy: reads the header only, so the size is known before decoding
        except Image.DecompressionBombError as error:
            raise ValueError(f"{name} is too large to decode safely ({error})") from error
        except (Image.UnidentifiedImageError, OSError) as error:
            raise ValueError(f"{name} is not a readable image ({error})") from error
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"{name} has size {width}x{height}; an image needs at least one pixel per side")
    if width * height > max_input_pixels:
        raise ValueError(f"{name} is {width}x{height} = {width * height:,} pixels, over the limit of "
                         f"{max_input_pixels:,} (decompression-bomb guard); shrink it first or raise "
                         f"max_input_pixels")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"{name} cannot be decoded (truncated or corrupt?): {error}") from error
    return image


def to_rgb(image):
    """An RGB copy of `image` by the conversions the module docstring lists."""
    Image = _pil()
    mode = image.mode
    if mode == "P" and "transparency" in image.info:
        image, mode = image.convert("RGBA"), "RGBA"
    if mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode in _WIDE_MODES:
        import numpy as np

        values = np.asarray(image, dtype=np.float64)
        if mode.startswith("I;16"):
            scaled = values / 257.0  # the full 16-bit range onto 0..255
        else:  # 32-bit int or float: no fixed range, so stretch the image's own
            low, high = float(values.min()), float(values.max())
            scaled = np.zeros_like(values) if high == low else (values - low) / (high - low) * 255.0
        return Image.fromarray(scaled.round().astype(np.uint8), mode="L").convert("RGB")
    if mode in _PLAIN_MODES:
        return image.convert("RGB") if mode != "RGB" else image
    raise ValueError(f"image mode {mode!r} is not supported; convert it to RGB first "
                     f"(supported: {', '.join(_PLAIN_MODES + _ALPHA_MODES + _WIDE_MODES)})")


def target_size(height: int, width: int, patch_size: int, merge: int, max_patches: int,
                max_side_patches: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) in pixels: the largest no-upscale size within both patch budgets, then
    padded up to a multiple of patch_size * merge."""
    patches = max(1, height // patch_size) * max(1, width // patch_size)
    scale = min(1.0, math.sqrt(max_patches / patches), max_side_patches * patch_size / height,
                max_side_patches * patch_size / width)
    new_h = min(max(1, int(height * scale)), max_side_patches * patch_size)
    new_w = min(max(1, int(width * scale)), max_side_patches * patch_size)
    factor = patch_size * merge
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def check_patches(patches: torch.Tensor, patch_size: int | None = None, channels: int = 3) -> None:
    """Clear errors for what is not a pack of uint8 patches [N, channels, p, p] (p = patch_size when given)."""
    if not isinstance(patches, torch.Tensor):
        raise ValueError(f"image patches must be a torch.Tensor of uint8 [patches, {channels}, p, p], got "
                         f"{type(patches).__name__}")
    if patches.dtype != torch.uint8:
        raise ValueError(f"image patches must be uint8 pixels 0..255 (ImageProcessor.clip_patches makes them), got "
                         f"{patches.dtype}; float pixel_values are already normalised and go to the tower as they are")
    p = patch_size
    if (patches.dim() != 4 or patches.shape[1] != channels or patches.shape[2] != patches.shape[3]
            or (p is not None and patches.shape[2] != p)):
        want = f"[patches, {channels}, {p or 'p'}, {p or 'p'}]"
        raise ValueError(f"image patches must be {want} (channels first), got shape {tuple(patches.shape)}")


def normalise(patches: torch.Tensor, mean: Sequence[float] | torch.Tensor = IMAGE_MEAN,
              std: Sequence[float] | torch.Tensor = IMAGE_STD, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 pixels [..., 3, h, w] -> (x / 255 - mean) / std per channel, computed in fp32 on the pixels' own
    device, then cast to dtype (padding reads (0 - mean) / std = -1). Elementwise, so patches cut before or after
    it are the same bits, and the host and a device give the same bits in fp32 (true divisions by tensors: a
    division by a Python number may become a multiplication by its reciprocal on a GPU)."""
    if patches.dtype != torch.uint8:
        raise ValueError(f"normalise takes uint8 pixels 0..255, got {patches.dtype}; normalising twice would "
                         f"rescale already normalised values again")
    if patches.dim() < 3 or patches.shape[-3] != 3:
        raise ValueError(f"normalise takes pixels [..., 3, h, w] (channels first), got shape {tuple(patches.shape)}")
    scale, shift, spread = _channel_stats(tuple(map(float, torch.as_tensor(mean).flatten().tolist())),
                                          tuple(map(float, torch.as_tensor(std).flatten().tolist())), patches.device)
    # in place on one fresh copy: ~3x faster on the host than a temporary per operation (~10^7 values a step)
    values = patches.to(torch.float32, copy=True).div_(scale).sub_(shift).div_(spread)
    return values if dtype == torch.float32 else values.to(dtype)


@functools.lru_cache(maxsize=16)
def _channel_stats(mean: tuple[float, ...], std: tuple[float, ...],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(255, mean, std) as fp32 [3, 1, 1] tensors on `device`, made once per device."""
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"mean and std need one value per channel (3), got {len(mean)} and {len(std)}")
    table = torch.tensor([[255.0] * 3, list(mean), list(std)], dtype=torch.float32).view(3, 3, 1, 1)
    return tuple(table.to(device).unbind(0))


@dataclass
class ProcessedImages:
    """Processed images as they travel: uint8 patches (a quarter of fp32's bytes) and their grid. pixel_values
    (host, fp32) and pixel_values_on (a device, its dtype) normalise them with the processor's mean and std."""
    patches: torch.Tensor  # [N, 3, p, p] uint8, N = sum of t*h*w
    grid_thw: torch.Tensor  # [n, 3] long: frames, patch rows, patch columns of each image / clip
    tokens_per_image: list[int] = field(default_factory=list)  # placeholders each entry becomes
    mean: tuple[float, float, float] = IMAGE_MEAN
    std: tuple[float, float, float] = IMAGE_STD

    def __post_init__(self) -> None:
        check_patches(self.patches)

    @property
    def pixel_values(self) -> torch.Tensor:
        """[N, 3, p, p] fp32, normalised on the host (a fresh tensor at every read)."""
        return normalise(self.patches, self.mean, self.std)

    def pixel_values_on(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, 3, p, p] in dtype on device: the uint8 patches moved there, then normalised there."""
        return normalise(self.patches.to(device, non_blocking=True), self.mean, self.std, dtype)


class ImageProcessor:
    """Resize within a pixel budget, pad to multiples of patch x merge, normalise, cut into patches."""

    def __init__(self, patch_size: int = 14, merge: int = 2, max_patches: int = DEFAULT_MAX_PATCHES,
                 max_side_patches: int = DEFAULT_MAX_SIDE_PATCHES, frames_per_clip: int = 4,
                 mean: Sequence[float] = IMAGE_MEAN, std: Sequence[float] = IMAGE_STD,
                 max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS) -> None:
        if max_patches < merge * merge:
            raise ValueError(f"max_patches {max_patches} is below one merged token ({merge * merge} patches)")
        self.patch_size, self.merge = patch_size, merge
        self.max_patches, self.max_side_patches = max_patches, max_side_patches
        self.frames_per_clip = frames_per_clip
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean and std need one value per channel (3), got {len(mean)} and {len(std)}")
        self.mean_values, self.std_values = tuple(map(float, mean)), tuple(map(float, std))
        self.mean, self.std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)
        self.max_input_pixels = max_input_pixels

    @classmethod
    def for_vision(cls, config: VisionConfig, **overrides) -> "ImageProcessor":
        if config.merge_kernel[0] != config.merge_kernel[1]:
            raise ValueError(f"ImageProcessor pads to a square merge kernel; got {config.merge_kernel}")
        values = dict(patch_size=config.patch_size, merge=config.merge_kernel[0],
                      frames_per_clip=config.pos_emb_time)
        values.update(overrides)
        return cls(**values)

    def _pixels(self, image, size: tuple[tuple[int, int], tuple[int, int]]) -> torch.Tensor:
        """[3, H, W] uint8, resized and padded with 0 (black)."""
        import numpy as np

        (new_h, new_w), (pad_h, pad_w) = size
        rgb = to_rgb(image)
        if rgb.size != (new_w, new_h):
            rgb = rgb.resize((new_w, new_h), resample=_pil().Resampling.BICUBIC)
        padded = torch.zeros(3, pad_h, pad_w, dtype=torch.uint8)
        padded[:, :new_h, :new_w] = torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy()).permute(2, 0, 1)
        return padded

    def normalise(self, pixels: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 pixels [..., 3, h, w] -> normalised with this processor's mean and std, on their own device
        (module function `normalise`)."""
        return normalise(pixels, self.mean_values, self.std_values, dtype)

    def pixel_values_on(self, patches: torch.Tensor, device: torch.device | str,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 patches [N, 3, p, p] (a batch's, on the host) -> checked, moved to device, normalised there in
        dtype: what the tower takes. A wrong dtype or shape is refused before any byte moves."""
        check_patches(patches, self.patch_size)
        return normalise(patches.to(device, non_blocking=True), self.mean_values, self.std_values, dtype)

    def _patches(self, frames: torch.Tensor) -> torch.Tensor:
        """[t, 3, H, W] -> [t * H/p * W/p, 3, p, p] in (frame, row, column) order."""
        t, c, height, width = frames.shape
        p = self.patch_size
        grid = frames.view(t, c, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)
        return grid.reshape(-1, c, p, p)

    def _size_of(self, image) -> tuple[tuple[int, int], tuple[int, int]]:
        width, height = image.size
        return target_size(height, width, self.patch_size, self.merge, self.max_patches, self.max_side_patches)

    def preprocess(self, images: Sequence[ImageSource]) -> ProcessedImages:
        """Each image one entry of grid_thw, t = 1."""
        return self._batch([[image] for image in images])

    __call__ = preprocess

    def preprocess_video(self, frames: Sequence[ImageSource]) -> ProcessedImages:
        """One video: frames of one size, in clips of at most frames_per_clip frames (one grid_thw entry each,
        t = the clip's frame count); every clip becomes h*w/4 tokens (mean over its frames)."""
        if not frames:
            raise ValueError("a video needs at least one frame")
        clips = [list(frames[i: i + self.frames_per_clip]) for i in range(0, len(frames), self.frames_per_clip)]
        return self._batch(clips)

    def clip_patches(self, frames: Sequence[ImageSource], index: int = 0) -> tuple[torch.Tensor, list[int]]:
        """One image or clip (frames of one size) -> (uint8 patches [t*h*w, 3, p, p], its grid [t, h, w]);
        `normalise` makes them pixel_values. A compact form to keep in memory (k3.vision.pixel_cache)."""
        opened = [open_image(source, self.max_input_pixels) for source in frames]
        sizes = {image.size for image in opened}
        if len(sizes) > 1:
            raise ValueError(f"clip {index}: frames have different sizes {sorted(sizes)}; resize them to one "
                             f"size first")
        size = self._size_of(opened[0])
        (_, _), (pad_h, pad_w) = size
        patches = self._patches(torch.stack([self._pixels(image, size) for image in opened]))
        return patches, [len(opened), pad_h // self.patch_size, pad_w // self.patch_size]

    def pack(self, entries: list[tuple[torch.Tensor, list[int]]]) -> ProcessedImages:
        """clip_patches' outputs, in order -> one ProcessedImages (uint8 patches concatenated; normalised when
        read as pixel_values or moved by pixel_values_on)."""
        if not entries:
            p = self.patch_size
            return ProcessedImages(torch.zeros(0, 3, p, p, dtype=torch.uint8), torch.zeros(0, 3, dtype=torch.long),
                                   [], self.mean_values, self.std_values)
        grids = [grid for _, grid in entries]
        tokens = [(h // self.merge) * (w // self.merge) for _, h, w in grids]
        patches = torch.cat([patches for patches, _ in entries])
        return ProcessedImages(patches, torch.tensor(grids, dtype=torch.long), tokens, self.mean_values,
                               self.std_values)

    def _batch(self, entries: list[list[ImageSource]]) -> ProcessedImages:
        return self.pack([self.clip_patches(entry, index) for index, entry in enumerate(entries)])


def expand_placeholders(token_ids: Sequence[int], tokens_per_image: Sequence[int],
                        media_token_id: int) -> list[int]:
    """Replace the i-th `media_token_id` in token_ids by tokens_per_image[i] copies of it (a prompt carries one
    placeholder per image; the model wants one per merged token). Counts that disagree are an error."""
    found = sum(1 for t in token_ids if t == media_token_id)
    if found != len(tokens_per_image):
        raise ValueError(f"the text has {found} media placeholder(s) (token {media_token_id}) but "
                         f"{len(tokens_per_image)} image(s) were given; put one placeholder per image")
    out: list[int] = []
    images = iter(tokens_per_image)
    for token in token_ids:
        if token == media_token_id:
            out.extend([media_token_id] * int(next(images)))
        else:
            out.append(int(token))
    return out
