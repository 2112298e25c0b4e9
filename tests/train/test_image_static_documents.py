"""The image-text step's static document form (what a GPU step runs: cu_seqlens padded to max_documents,
attention masked within rows) gives the loss and gradients of the per-document form, on a mixed batch."""

import pytest
import torch

from k3.train.trainer import Trainer
from test_image_training import image_config, image_data  # noqa: F401  (the fixture)

pytest.importorskip("PIL.Image")


def spy_max_documents(trainer, monkeypatch) -> list:
    """The max_documents each language-model forward is given (None: the per-document form)."""
    seen, forward = [], trainer.model.forward

    def recording(*args, **kwargs):
        seen.append(kwargs.get("max_documents"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(trainer.model, "forward", recording)
    return seen


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    trainer.images.vision.zero_grad(set_to_none=True)
    loss = trainer._forward(batch)
    loss.backward()
    params = [*trainer.model.named_parameters(), *trainer.images.vision.named_parameters()]
    return loss.detach(), {n: p.grad.clone() for n, p in params if p.grad is not None}


def test_static_documents_equal_per_document_on_an_image_text_batch(tmp_path, corpus_dir, small_config,
                                                                   image_data, monkeypatch):  # noqa: F811
    trainer = Trainer(image_config(small_config, tmp_path / "run", corpus_dir, image_data, max_steps=1),
                      show_progress=False)
    trainer.model.eval()  # the routers' bias frozen: both forwards route alike
    batch, _ = trainer._next_batch()
    assert batch.image_patches is not None and batch.cu_seqlens.numel() - 1 > 4  # several documents a row
    seen = spy_max_documents(trainer, monkeypatch)
    trainer.static_image_documents = False
    want, want_grads = loss_and_grads(trainer, batch)
    trainer.static_image_documents = True
    got, got_grads = loss_and_grads(trainer, batch)
    assert seen == [None, trainer.max_documents(4)]  # the second forward took the static form
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and any(n.startswith("vision_tower.") for n in got_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_too_many_documents_fall_back_to_the_per_document_form(tmp_path, corpus_dir, small_config,
                                                               image_data, monkeypatch):  # noqa: F811
    trainer = Trainer(image_config(small_config, tmp_path / "run", corpus_dir, image_data, max_steps=1),
                      show_progress=False)
    trainer.static_image_documents = True
    batch, _ = trainer._next_batch()
    monkeypatch.setattr(trainer, "max_documents", lambda rows=None: batch.cu_seqlens.numel() - 2)
    seen = spy_max_documents(trainer, monkeypatch)
    assert torch.isfinite(trainer._forward(batch))
    assert seen == [None]
