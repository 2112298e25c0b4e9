"""A training step packs images of different sizes into one tower call (cu_seqlens over the patches, no padding
to the largest) and their examples into one row of documents: its loss and every gradient (tower, projector,
language model) equal those of the same examples run one by one, unpacked (fp32, CPU)."""

import json
from pathlib import Path

import pytest
import torch

from k3.train.trainer import Trainer

Image = pytest.importorskip("PIL.Image")
# (width, height) px: patch grids 2x2, 2x4, 4x6, 6x2 and a 2x2 after the resize into the patch budget
SIZES = [(28, 28), (56, 28), (84, 56), (28, 84), (70, 70)]


@pytest.fixture
def mixed_size_images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    records = []
    for i, (width, height) in enumerate(SIZES * 2):
        pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
        Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
        records.append({"text": f"picture {i}: <image> is number {i}", "images": [f"{i}.png"]})
    records.append({"text": "two: <image> and <image> end", "images": ["1.png", "2.png"]})
    path = folder / "mm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_packed_step_equals_its_examples_one_by_one(tmp_path, corpus_dir, small_config, mixed_size_images):
    config = small_config(tmp_path / "run", corpus_dir, data=[str(corpus_dir), str(mixed_size_images)],
                          recall_fraction=0.0, batch_size=4, seq_len=96, val_fraction=0.01, image_fraction=0.5,
                          max_image_patches=16, dtype="fp32", device="cpu")
    trainer = Trainer(config, log=lambda *_: None)
    batch, _ = trainer._next_batch()
    sizes = {tuple(g) for g in batch.grid_thw.tolist()}
    assert len(batch.grid_thw) >= 4 and len(sizes) >= 3, "the step should pack several images of different sizes"
    multimodal = trainer.images.multimodal
    parameters = [p for p in multimodal.parameters() if p.requires_grad]

    packed_loss = trainer._forward(batch)
    packed_grads = torch.autograd.grad(packed_loss, parameters, allow_unused=True)

    # The same documents one at a time: each its own forward, with only its own images through the tower.
    scored = int((batch.labels != -100).sum())
    bounds = batch.cu_seqlens.tolist()
    media = multimodal.media_token_id
    tokens_per_image = trainer.images.vision.tokens_per_image(batch.grid_thw)
    patches = batch.grid_thw.prod(-1).tolist()
    image, patch = 0, 0
    total = torch.zeros(())
    for start, end in zip(bounds[:-1], bounds[1:]):
        ids, labels = batch.input_ids[:, start:end], batch.labels[:, start:end]
        count, placeholders = 0, int((ids == media).sum())
        while placeholders > 0:
            placeholders -= tokens_per_image[image + count]
            count += 1
        pixels = grid = None
        if count:
            used = sum(patches[image:image + count])
            pixels = trainer.images.processor.normalise(batch.image_patches[patch:patch + used])
            grid = batch.grid_thw[image:image + count]
            image, patch = image + count, patch + used
        if (labels == -100).all():
            continue  # a filler document: no loss, and its ids pass the model alone
        out = multimodal(ids, pixels, grid, labels=labels)
        total = total + out.loss * int((labels != -100).sum()) / scored
    assert image == len(batch.grid_thw)
    unpacked_grads = torch.autograd.grad(total, parameters, allow_unused=True)

    assert torch.allclose(packed_loss, total, rtol=1e-5, atol=1e-6)
    tower_grads = 0
    for (name, _), a, b in zip([(n, p) for n, p in multimodal.named_parameters() if p.requires_grad],
                               packed_grads, unpacked_grads):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        tower_grads += name.startswith("vision.vision_tower.") and bool(a.abs().sum() > 0)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()) + 1e-9), \
            f"{name}: {float((a - b).abs().max())} vs scale {float(b.abs().max())}"
    assert tower_grads > 0, "the tower must receive gradient in this step"
