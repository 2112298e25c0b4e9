"""Processed images kept in memory, so a training run decodes each image once instead of at every step.

    pixels = PixelCache(processor)                                  # at most DEFAULT_MAX_BYTES (1 GiB)
    batch = pixels(["/data/a.png", "data:image/png;base64,..."])   # ProcessedImages, as processor(...) gives

An entry is an image's uint8 patches and grid (a quarter of the fp32 pixel_values' bytes); a batch keeps them
uint8 (ProcessedImages.patches) until the step's device normalises them. The least recently used entries leave
once the entries hold more than max_bytes (0: nothing is kept). A file is keyed by its path with its size, modification time and inode, so
an image rewritten during a run is decoded again and one removed is the processor's error, as without a cache;
a data: URL is keyed by its text.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import torch

from k3.vision.processing import ImageProcessor, ProcessedImages

DEFAULT_MAX_BYTES = 1 << 30  # 1.8M patches: ~7,100 images of 224 x 224, ~790 of 672 x 672


class PixelCache:
    def __init__(self, processor: ImageProcessor, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"the image cache's size must be >= 0 bytes (0: no cache), got {max_bytes}")
        self.processor, self.max_bytes = processor, max_bytes
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, list[int]]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def __call__(self, sources: Sequence[str]) -> ProcessedImages:
        """Every source (a path or a data: URL) as one image, in order."""
        return self.processor.pack([self._entry(source) for source in sources])

    def _entry(self, source: str) -> tuple[torch.Tensor, list[int]]:
        key = _key(source)
        if key is not None and key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self.misses += 1
        entry = self.processor.clip_patches([source])
        size = entry[0].numel()  # uint8
        if key is not None and size <= self.max_bytes:
            self._entries[key] = entry
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (patches, _) = self._entries.popitem(last=False)
                self.bytes -= patches.numel()
        return entry


def _key(source: str) -> tuple | None:
    """What identifies an image's content without reading it; None when the file cannot be stat'ed (the
    processor then says why)."""
    if source.startswith("data:"):
        return ("data", source)
    try:
        stat = os.stat(source)
    except OSError:
        return None
    return ("file", source, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev)
