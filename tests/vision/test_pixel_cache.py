"""k3.vision.pixel_cache: images decoded once, the same bits as the processor, bounded, and a changed or removed
file seen as without a cache."""

import base64
import io
import os

import pytest
import torch

from k3.vision.pixel_cache import PixelCache
from k3.vision.processing import ImageProcessor

Image = pytest.importorskip("PIL.Image")
PROCESSOR = ImageProcessor(max_patches=64)


def noise(size, seed):
    generator = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), dtype=torch.uint8,
                                         generator=generator).numpy())


def noise_png(path, size, seed):
    noise(size, seed).save(path)
    return str(path)


def data_url(size, seed):
    buffer = io.BytesIO()
    noise(size, seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def assert_same(a, b):
    assert torch.equal(a.pixel_values, b.pixel_values)
    assert torch.equal(a.grid_thw, b.grid_thw)
    assert a.tokens_per_image == b.tokens_per_image


def test_cached_images_are_the_processors_bits_and_decoded_once(tmp_path):
    # mixed sizes, one scaled down into the patch budget, one repeated, one data: URL
    sources = [noise_png(tmp_path / "a.png", (56, 28), 0), noise_png(tmp_path / "b.png", (200, 150), 1),
               data_url((30, 45), 2)]
    sources.append(sources[0])
    cache = PixelCache(PROCESSOR, max_bytes=1 << 20)
    first = cache(sources)
    assert_same(first, PROCESSOR(sources))
    assert (cache.misses, cache.hits) == (3, 1)
    assert_same(cache(sources[::-1]), PROCESSOR(sources[::-1]))
    assert (cache.misses, cache.hits) == (3, 5)


def test_the_cache_keeps_at_most_max_bytes_dropping_the_least_recently_used(tmp_path):
    sources = [noise_png(tmp_path / f"{i}.png", (56, 56), i) for i in range(3)]
    one = 56 * 56 * 3  # uint8 patches of one image (56 px: no padding)
    cache = PixelCache(PROCESSOR, max_bytes=2 * one)
    cache(sources[:2])
    cache(sources[:1])  # 0 is now the most recently used
    cache(sources[2:])  # 1 leaves
    assert cache.bytes == 2 * one
    misses = cache.misses
    cache([sources[0], sources[2]])
    assert cache.misses == misses
    cache([sources[1]])
    assert cache.misses == misses + 1


def test_a_zero_sized_cache_keeps_nothing(tmp_path):
    source = noise_png(tmp_path / "a.png", (28, 28), 0)
    cache = PixelCache(PROCESSOR, max_bytes=0)
    assert_same(cache([source, source]), PROCESSOR([source, source]))
    assert (cache.bytes, cache.hits, cache.misses) == (0, 0, 2)


def test_a_negative_size_is_refused():
    with pytest.raises(ValueError, match="image cache's size must be >= 0"):
        PixelCache(PROCESSOR, max_bytes=-1)


def test_a_file_rewritten_during_the_run_is_decoded_again(tmp_path):
    path = tmp_path / "a.png"
    source = noise_png(path, (28, 28), 0)
    cache = PixelCache(PROCESSOR, max_bytes=1 << 20)
    before = cache([source])
    stat = os.stat(source)
    noise_png(path, (28, 28), 1)  # same size in bytes is possible; the modification time moves on
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    after = cache([source])
    assert_same(after, PROCESSOR([source]))
    assert not torch.equal(before.pixel_values, after.pixel_values)


def test_a_file_removed_after_caching_is_the_processors_error(tmp_path):
    source = noise_png(tmp_path / "a.png", (28, 28), 0)
    cache = PixelCache(PROCESSOR, max_bytes=1 << 20)
    cache([source])
    os.unlink(source)
    with pytest.raises(FileNotFoundError, match="a.png does not exist"):
        cache([source])
