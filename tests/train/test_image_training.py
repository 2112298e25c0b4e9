"""`k3 train` on image-text data: the tower trained with the model (or frozen), its own learning rate, the vision
weights in the checkpoint, and a resumed run equal to an unbroken one with images in every step."""

import json
from pathlib import Path

import pytest
import torch

from k3.checkpoint.native import load_checkpoint
from k3.train.metrics import read_metrics
from k3.train.trainer import Trainer

Image = pytest.importorskip("PIL.Image")
COLOURS = {"red": (255, 0, 0), "blue": (0, 0, 255), "green": (0, 160, 0), "white": (255, 255, 255)}


@pytest.fixture
def image_data(tmp_path: Path) -> Path:
    """12 records (documents and chats) over small images of two sizes, in their own folder."""
    folder = tmp_path / "images"
    folder.mkdir()
    records = []
    for i in range(12):
        name = list(COLOURS)[i % 4]
        Image.new("RGB", (28 * (1 + i % 2), 28), COLOURS[name]).save(folder / f"{i}.png")
        if i % 3:
            records.append({"text": f"a <image> {name} one", "images": [f"{i}.png"]})
        else:
            records.append({"messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{i}.png"}},
                                             {"type": "text", "text": "colour?"}]},
                {"role": "assistant", "content": name}]})
    path = folder / "mm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def image_config(small_config, out, corpus_dir, image_data, **changes):
    values = dict(data=[str(corpus_dir), str(image_data)], recall_fraction=0.0, batch_size=4, seq_len=64,
                  val_fraction=0.25)
    values.update(changes)
    return small_config(out, corpus_dir, **values)


def vision_state(trainer):
    return {k: v.detach().clone() for k, v in trainer.images.vision.state_dict().items()}


def changed(before, after, prefix):
    names = [k for k in before if k.startswith(prefix)]
    assert names
    return any(not torch.equal(before[k], after[k]) for k in names)


@pytest.mark.parametrize("mode,tower,projector", [("all", True, True), ("projector", False, True),
                                                  ("none", False, False)])
def test_a_step_reaches_the_tower_only_when_not_frozen(tmp_path, corpus_dir, small_config, image_data, mode, tower,
                                                       projector):
    trainer = Trainer(image_config(small_config, tmp_path / "run", corpus_dir, image_data, vision_train=mode,
                                   max_steps=1, eval_every=1), show_progress=False)
    text_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    before = vision_state(trainer)
    batch, _ = trainer._next_batch()
    assert batch.image_patches is not None and int(batch.grid_thw.shape[0]) >= 1  # a step mixes images in
    assert batch.input_ids.shape[1] == 4 * 64
    media = trainer.images.media_token_id  # two text rows, then two image rows: the step mixes both
    assert not (batch.input_ids[0, :128] == media).any() and (batch.input_ids[0, 128:] == media).any()
    trainer.train()
    after = vision_state(trainer)
    assert changed(before, after, "vision_tower.") == tower
    assert changed(before, after, "mm_projector.") == projector
    assert any(not torch.equal(text_before[k], v) for k, v in trainer.model.state_dict().items())
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert all((id(p) in trained) == tower for p in trainer.images.vision.vision_tower.parameters())


def test_vision_lr_scales_the_vision_groups(tmp_path, corpus_dir, small_config, image_data):
    trainer = Trainer(image_config(small_config, tmp_path / "run", corpus_dir, image_data, lr=3e-3, vision_lr=1e-3,
                                   max_steps=2, eval_every=2, warmup_steps=1), show_progress=False)
    trainer.train()
    vision_ids = {id(p) for p in trainer.images.vision.parameters()}
    text_lr = {g["lr"] for g in trainer.optimizer.param_groups if id(g["params"][0]) not in vision_ids}
    vision_lr = {g["lr"] for g in trainer.optimizer.param_groups if id(g["params"][0]) in vision_ids}
    [lr], [scaled] = text_lr, vision_lr
    assert lr > 0 and scaled == pytest.approx(lr / 3)


def test_resume_with_images_equals_an_unbroken_run(tmp_path, corpus_dir, small_config, image_data):
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    make = lambda out: image_config(small_config, out, corpus_dir, image_data, max_steps=5, save_every=2,  # noqa: E731
                                    eval_every=5, vision_lr=1e-3)
    Trainer(make(unbroken), show_progress=False).train()
    Trainer(make(broken), show_progress=False).train(stop_at=3)  # the last checkpoint is step 2
    assert load_checkpoint(broken / "checkpoint.pt")["step"] == 2
    Trainer(make(broken), resume=True, show_progress=False).train()

    def losses(run):
        return {r["step"]: (r["loss"], r.get("val_image_loss")) for r in read_metrics(run / "metrics.jsonl")
                if "loss" in r}

    assert losses(broken) == losses(unbroken) and len(losses(unbroken)) == 5
    a, b = load_checkpoint(unbroken / "checkpoint.pt"), load_checkpoint(broken / "checkpoint.pt")
    assert a["vision_config"] == b["vision_config"] and a["media_token_id"] == b["media_token_id"]
    assert any(k.startswith("vision_tower.") for k in a["vision"])
    for key in ("model", "vision"):
        assert a[key].keys() == b[key].keys()
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key])


def test_skip_bad_images_counts_them_in_the_summary(tmp_path, corpus_dir, small_config, image_data):
    with open(image_data, "a") as handle:
        handle.write(json.dumps({"text": "<image>", "images": ["missing.png"]}) + "\n")
    config = image_config(small_config, tmp_path / "stops", corpus_dir, image_data, max_steps=1)
    with pytest.raises(ValueError, match=r"mm.jsonl:13: field \"images\"\[0\]: image file .* does not exist"):
        Trainer(config, show_progress=False)
    trainer = Trainer(image_config(small_config, tmp_path / "skips", corpus_dir, image_data, max_steps=1,
                                   skip_bad_images=True), show_progress=False)
    # The 12 good records, split between training and validation by a hash of their file:line.
    assert len(trainer.images.train_examples) + len(trainer.images.val_examples) == 12
    summary = trainer.train()
    assert summary["skipped_image_records"] == 1
    assert summary["image_examples"] == len(trainer.images.train_examples)


def test_cli_flags_reach_the_run(tmp_path, corpus_dir, image_data, capsys):
    from k3.cli import main

    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--out", str(run), "--data", str(corpus_dir), "--data",
                 str(image_data), "--max-steps", "1", "--seq-len", "64", "--batch-size", "4", "--eval-batches", "1",
                 "--val-fraction", "0.25", "--vision-train", "projector", "--vision-lr", "1e-3",
                 "--image-fraction", "0.25", "--max-image-patches", "64", "--skip-bad-images"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-2])
    assert summary["skipped_image_records"] == 0 and summary["steps"] == 1
    saved = json.loads((run / "train_config.json").read_text())["images"]
    assert (saved["vision_train"], saved["vision_lr"], saved["image_fraction"], saved["max_image_patches"],
            saved["skip_bad_images"]) == ("projector", 1e-3, 0.25, 64, True)
    for command in ("train", "sft"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--vision-train {all,projector,none}" in capsys.readouterr().out
