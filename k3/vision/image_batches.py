"""Image-text examples packed into rows beside text rows, so one training step mixes both.

    rows = pack_image_rows(examples, count=2, row_length=256, filler_id=eos, rng=random.Random("0/7"))
    batch = mixed_batch(pack_rows(text_rows, eos), rows, processor)    # PackedBatch with image_patches, grid_thw

Each image row holds whole examples (an example is never cut, so a row never splits an image's placeholders),
each its own document in cu_seqlens, and a filler document (EOS ids, no loss) up to row_length. The images come
in reading order: text rows hold none, then image rows one after another, as the model's embed_multimodal wants.
The images stay uint8 patches here; the step normalises them on its device (ImageProcessor.pixel_values_on).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from k3.data.packing import PackedBatch
from k3.vision.image_text import ImageTextExample


@dataclass
class ImageRow:
    ids: list[int]  # [row_length]
    labels: list[int]  # [row_length], -100 where not scored
    lengths: list[int]  # documents of the row (examples, then the filler), summing to row_length
    images: list[str]  # paths / data: URLs of the row's media tokens, in order


def pack_image_rows(examples: list[ImageTextExample], count: int, row_length: int, filler_id: int,
                    rng: random.Random) -> list[ImageRow]:
    """`count` rows of examples drawn from `examples` (with replacement, by rng); each example must fit a row."""
    if not examples:
        raise ValueError("no image-text examples to draw rows from")
    rows, pending = [], None
    for _ in range(count):
        row = ImageRow([], [], [], [])
        while len(row.ids) < row_length:
            example = pending if pending is not None else examples[rng.randrange(len(examples))]
            pending = None
            if len(example.ids) > row_length:
                raise ValueError(f"{example.source}: {len(example.ids)} tokens do not fit a row of {row_length}")
            if len(row.ids) + len(example.ids) > row_length:
                pending = example  # opens the next row
                break
            row.ids += example.ids
            row.labels += example.labels
            row.lengths.append(len(example.ids))
            row.images += example.images
        filler = row_length - len(row.ids)
        if filler:
            row.ids += [filler_id] * filler
            row.labels += [-100] * filler
            row.lengths.append(filler)
        rows.append(row)
    return rows


def mixed_batch(text: PackedBatch | None, rows: list[ImageRow], processor) -> PackedBatch:
    """The text rows' packed batch (or None) followed by the image rows, with the images processed into uint8
    patches (processor: an ImageProcessor or a PixelCache)."""
    ids = [text.input_ids[0]] if text is not None else []
    labels = [text.labels[0]] if text is not None else []
    cu = text.cu_seqlens.tolist() if text is not None else [0]
    weights = [text.weights[0]] if text is not None and text.weights is not None else None
    images: list[str] = []
    for row in rows:
        ids.append(torch.tensor(row.ids, dtype=torch.int64))
        labels.append(torch.tensor(row.labels, dtype=torch.int64))
        if weights is not None:
            weights.append(torch.ones(len(row.ids), dtype=torch.float32))
        base = cu[-1]
        cu.extend(base + int(end) for end in np.cumsum(row.lengths))
        images += row.images
    try:
        processed = processor(images) if images else None
    except (ValueError, OSError) as error:  # every image was read whole when the data was; a file changed since
        raise ValueError(f"an image of this step cannot be read any more ({error}); it was readable when the run "
                         f"read its data: restore the file, or start a new run without it") from error
    return PackedBatch(torch.cat(ids)[None], torch.cat(labels)[None], torch.tensor(cu, dtype=torch.int64),
                       torch.cat(weights)[None] if weights is not None else None,
                       processed.patches if processed is not None else None,
                       processed.grid_thw if processed is not None else None)
