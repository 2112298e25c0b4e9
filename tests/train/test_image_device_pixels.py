"""An image-text training step whose batch carries uint8 patches, normalised on the step's device, has the loss and
every gradient of the step that took fp32 pixel_values normalised on the host (CPU, fp32); a batch whose patches
are not uint8 [N, 3, p, p] is refused before the tower."""

import dataclasses

import pytest
import torch

from k3.train.trainer import Trainer
from test_image_static_documents import loss_and_grads
from test_packed_images import mixed_size_images  # noqa: F401  (the fixture: noise images of five sizes)

pytest.importorskip("PIL.Image")


def host_normalised_embed(images):
    """The step's image embedding as it was: pixel_values normalised in fp32 on the host, then moved."""
    multimodal, processor = images.multimodal, images.processor

    def embed(ids, batch):
        pixel_values = (batch.image_patches.float() / 255.0 - processor.mean) / processor.std
        dtype = next(multimodal.vision.parameters()).dtype
        return multimodal.embed_multimodal(ids, pixel_values.to(ids.device, dtype), batch.grid_thw.cpu())
    return embed


def record_tower_inputs(trainer) -> list[torch.Tensor]:
    seen = []
    proj = trainer.images.vision.vision_tower.patch_embed.proj
    proj.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    return seen


@pytest.fixture
def trainer(tmp_path, corpus_dir, small_config, mixed_size_images):  # noqa: F811
    config = small_config(tmp_path / "run", corpus_dir, data=[str(corpus_dir), str(mixed_size_images)],
                          recall_fraction=0.0, batch_size=4, seq_len=96, val_fraction=0.01, image_fraction=0.5,
                          max_image_patches=16, max_steps=1, dtype="fp32", device="cpu")
    trainer = Trainer(config, show_progress=False, log=lambda *_: None)
    trainer.model.eval()  # the routers' bias frozen: both forwards route alike
    return trainer


def test_device_normalised_step_equals_the_host_normalised_one(trainer, monkeypatch):
    batch, _ = trainer._next_batch()
    assert batch.image_patches.dtype == torch.uint8 and batch.image_patches.shape[1:] == (3, 14, 14)
    seen = record_tower_inputs(trainer)
    got, got_grads = loss_and_grads(trainer, batch)
    monkeypatch.setattr(trainer.images, "embed", host_normalised_embed(trainer.images))
    want, want_grads = loss_and_grads(trainer, batch)
    assert len(seen) == 2 and seen[0].dtype == torch.float32 and torch.equal(seen[0], seen[1])
    assert torch.equal(got, want)
    assert got_grads.keys() == want_grads.keys() and any(n.startswith("vision_tower.") for n in got_grads)
    for name in want_grads:
        assert torch.equal(got_grads[name], want_grads[name]), name


def test_a_batch_of_float_pixels_is_refused_before_the_tower(trainer):
    batch, _ = trainer._next_batch()
    seen = record_tower_inputs(trainer)
    hostile = dataclasses.replace(batch, image_patches=batch.image_patches.float())
    with pytest.raises(ValueError, match="must be uint8 pixels 0..255"):
        trainer._forward(hostile)
    assert seen == []


def test_a_batch_of_channels_last_patches_is_refused_before_the_tower(trainer):
    batch, _ = trainer._next_batch()
    seen = record_tower_inputs(trainer)
    hostile = dataclasses.replace(batch, image_patches=batch.image_patches.permute(0, 2, 3, 1).contiguous())
    with pytest.raises(ValueError, match=r"must be \[patches, 3, 14, 14\] \(channels first\)"):
        trainer._forward(hostile)
    assert seen == []
