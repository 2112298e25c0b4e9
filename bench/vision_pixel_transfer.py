"""Bytes an image-text training step sends to the device, and the host time of building its batch: the images as
uint8 patches normalised on the device (now) against fp32 pixel_values normalised on the host (before), side by
side in one run, on the CPU.

    python bench/vision_pixel_transfer.py --out DIR [--rows 1] [--steps 20] [--json]

Rows: what bench/vision_train_gpu.py trains on (synthetic VQA pictures of 112, 224, 336 and 448 px, K3's tower
sizes: ~30 images and ~14k patches in a row of 4,096 tokens), each step's rows drawn as k3 train draws them
(pack_image_rows) and built by mixed_batch from a warm PixelCache (each picture decoded once, as in a run).
"before" is the same build followed by the host normalisation the batch used to carry out (the removed code:
one fp32 copy of the patches, / 255, - mean, / std, in place). Bytes: every tensor the step moves to the device
(ids, labels, cu_seqlens, the images). "device_normalise_ms" is the normalisation the device now does, timed
here on the CPU only to show what left the host path: a GPU does it in a few elementwise kernels.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.vision_train_gpu import write_data  # noqa: E402


def old_host_normalise(patches: torch.Tensor, processor) -> torch.Tensor:
    """The host normalisation a batch used to carry out (ImageProcessor.normalise before the patches travelled)."""
    return patches.to(torch.float32, copy=True).div_(255.0).sub_(processor.mean).div_(processor.std)


def step_bytes(batch, pixels: torch.Tensor) -> int:
    """What one step moves to the device: its token tensors and its images (grid_thw stays on the host)."""
    tensors = [batch.input_ids, batch.labels, batch.cu_seqlens, batch.weights, pixels]
    return sum(t.nbytes for t in tensors if t is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a folder for the synthetic pictures and tokenizer")
    parser.add_argument("--rows", type=int, default=1, help="image rows of 4,096 tokens a step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--per-size", type=int, default=64, help="pictures of each size")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from k3.data.tokenizer import load_tokenizer
    from k3.train.images import image_processor
    from k3.vision.config import VisionConfig
    from k3.vision.image_batches import mixed_batch, pack_image_rows
    from k3.vision.image_text import media_token_id_for, read_image_text
    from k3.vision.pixel_cache import PixelCache

    out = Path(args.out)
    data = write_data(out / "data", [112, 224, 336, 448], args.per_size)
    tokenizer = load_tokenizer(out / "data" / "tokenizer")
    processor = image_processor(VisionConfig.from_preset("k3"), None, None)
    examples = read_image_text([data], tokenizer, processor, media_token_id_for(tokenizer)).examples
    pixels = PixelCache(processor)
    row_length, filler = 4096, tokenizer.eos_token_id

    def build(step: int):
        rows = pack_image_rows(examples, args.rows, row_length, filler, random.Random(f"0/image-rows/{step}"))
        return mixed_batch(None, rows, pixels)

    for step in range(args.steps):  # warm: every picture of the steps decoded into the cache once
        build(step)
    warm_misses = pixels.misses
    after_ms, before_ms, device_ms, patches = [], [], [], []
    after_bytes = before_bytes = pixel_after = pixel_before = 0
    for step in range(args.steps):  # alternating, so that drifts of the machine fall on both alike
        t0 = time.perf_counter()
        batch = build(step)
        t1 = time.perf_counter()
        old = build(step)
        host_pixels = old_host_normalise(old.image_patches, processor)
        t2 = time.perf_counter()
        processor.normalise(batch.image_patches)
        t3 = time.perf_counter()
        after_ms.append(1e3 * (t1 - t0))
        before_ms.append(1e3 * (t2 - t1))
        device_ms.append(1e3 * (t3 - t2))
        patches.append(batch.image_patches.shape[0])
        after_bytes += step_bytes(batch, batch.image_patches)
        before_bytes += step_bytes(old, host_pixels)
        pixel_after += batch.image_patches.nbytes
        pixel_before += host_pixels.nbytes
    steps = args.steps
    result = {
        "rows": args.rows, "row_length": row_length, "steps": steps, "patches_per_step": sum(patches) / steps,
        "images_decoded_while_timed": pixels.misses - warm_misses,
        "image_bytes_per_step_before": pixel_before / steps, "image_bytes_per_step_after": pixel_after / steps,
        "step_bytes_before": before_bytes / steps, "step_bytes_after": after_bytes / steps,
        "step_bytes_ratio": before_bytes / after_bytes,
        "host_build_ms_median_before": statistics.median(before_ms),
        "host_build_ms_median_after": statistics.median(after_ms),
        "host_build_ratio": statistics.median(before_ms) / statistics.median(after_ms),
        "device_normalise_ms_median_on_cpu": statistics.median(device_ms),
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{result['patches_per_step']:.0f} patches a step ({args.rows} row(s) of {row_length} tokens)")
        print(f"bytes to the device a step: {result['step_bytes_before'] / 2**20:.2f} MiB before, "
              f"{result['step_bytes_after'] / 2**20:.2f} MiB now: {result['step_bytes_ratio']:.2f}x fewer")
        print(f"host batch build, median: {result['host_build_ms_median_before']:.1f} ms before, "
              f"{result['host_build_ms_median_after']:.1f} ms now: {result['host_build_ratio']:.2f}x")
        print(f"(normalisation now on the device; on this CPU it takes "
              f"{result['device_normalise_ms_median_on_cpu']:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
