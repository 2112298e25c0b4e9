"""`k3 sft` on chats with image_url parts: the vision tower trained with the model (or frozen), kept in the
checkpoint, and a resumed run equal to an unbroken one."""

import json

import pytest
import torch

from k3.checkpoint.native import load_checkpoint
from k3.config import ModelConfig
from k3.model import K3ForCausalLM
from k3.rl.sft import SFTConfig, SFTTrainer
from k3.train.metrics import read_metrics

Image = pytest.importorskip("PIL.Image")
COLOURS = {"red": (255, 0, 0), "blue": (0, 0, 255), "green": (0, 160, 0)}


@pytest.fixture(scope="module")
def tokenizer():
    from k3.data.tokenizer import train_bpe

    return train_bpe(["<|user|>what colour is it?\n<|assistant|>red blue green\n"] * 20, 300, show_progress=False)


@pytest.fixture
def demos(tmp_path):
    records = []
    for i, (name, colour) in enumerate(COLOURS.items()):
        Image.new("RGB", (28 * (1 + i % 2), 28), colour).save(tmp_path / f"{name}.png")
        records.append({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "what colour is it?"},
                                         {"type": "image_url", "image_url": {"url": f"{name}.png"}}]},
            {"role": "assistant", "content": name}]})
    records.append({"messages": [{"role": "user", "content": "say red"}, {"role": "assistant", "content": "red"}]})
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def start_model(tokenizer):
    torch.manual_seed(0)  # room for the media token: one id past the tokenizer's
    return K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size + 1,
                                                 eos_token_id=tokenizer.eos_token_id))


def sft(out, demos, tokenizer, resume=False, **changes):
    values = dict(data=str(demos), out=str(out), steps=4, batch_size=3, save_every=2, device="cpu", vision="tiny",
                  vision_lr=5e-4)
    config = SFTConfig.flat(**{**values, **changes})
    return SFTTrainer(config, resume=resume, model=None if resume else start_model(tokenizer),
                      tokenizer=None if resume else tokenizer, show_progress=False, log=lambda *_: None)


def test_image_sft_trains_the_tower_and_resumes_exactly(tmp_path, demos, tokenizer):
    unbroken = sft(tmp_path / "unbroken", demos, tokenizer)
    tower_before = {k: v.clone() for k, v in unbroken.multimodal.vision.state_dict().items()}
    assert unbroken.batch_images(1) is not None
    unbroken.train()
    state = load_checkpoint(tmp_path / "unbroken")
    assert any(not torch.equal(tower_before[k], state["vision"][k]) for k in tower_before
               if k.startswith("vision_tower."))
    sft(tmp_path / "broken", demos, tokenizer).train(stop_at=2)
    sft(tmp_path / "broken", demos, tokenizer, resume=True).train()

    def losses(run):
        return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]

    assert losses(tmp_path / "broken") == losses(tmp_path / "unbroken") and len(losses(tmp_path / "unbroken")) == 4
    again = load_checkpoint(tmp_path / "broken")
    for key in ("model", "vision"):
        assert all(torch.equal(state[key][k], again[key][k]) for k in state[key])
    assert again["media_token_id"] == tokenizer.vocab_size


def test_image_sft_with_the_projector_only_leaves_the_tower(tmp_path, demos, tokenizer):
    trainer = sft(tmp_path / "run", demos, tokenizer, vision_train="projector", steps=1)
    before = {k: v.clone() for k, v in trainer.multimodal.vision.state_dict().items()}
    trainer.train()
    after = trainer.multimodal.vision.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("vision_tower."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("mm_projector."))


@pytest.mark.slow
def test_image_sft_learns_an_answer_only_the_image_holds(tmp_path):
    """A colour question over solid, jittered images of random sizes: the answer is in the image alone, so
    held-out accuracy far above the most frequent answer shows images reach the loss and the tower learns
    (measured: 0.28 before, 1.00 after 60 steps on 60 held-out images; about 80 s on 2 busy cores)."""
    import random

    from k3.data.tokenizer import train_bpe
    from k3.vision.image_text import ImageDataOptions, ImageTextReader

    colours = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}
    rng = random.Random(0)

    def chat(i, answer):
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "colour?"},
                                                          {"type": "image_url", "image_url": {"url": f"{i}.png"}}]},
                             {"role": "assistant", "content": answer}]}

    def record(i, name):
        jitter = tuple(max(0, min(255, v + rng.randint(-30, 30))) for v in colours[name])
        Image.new("RGB", (28 * rng.randint(1, 2), 28 * rng.randint(1, 2)), jitter).save(tmp_path / f"{i}.png")
        return chat(i, name)

    train = [record(i, rng.choice(list(colours))) for i in range(60)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    held = [(i, rng.choice(list(colours))) for i in range(60, 120)]
    for i, name in held:
        record(i, name)
    tokenizer = train_bpe(["<|user|>colour?\n<|assistant|>red blue green\n"] * 50, 300, show_progress=False)
    config = SFTConfig.flat(data=str(tmp_path / "train.jsonl"), out=str(tmp_path / "out"), steps=60, batch_size=8,
                            lr=2e-3, device="cpu", vision="tiny", save_every=1000)
    trainer = SFTTrainer(config, model=start_model(tokenizer), tokenizer=tokenizer, show_progress=False,
                         log=lambda *_: None)

    def accuracy():
        model = trainer.multimodal.eval()
        reader = ImageTextReader(tokenizer, trainer.processor, model.media_token_id, ImageDataOptions())
        correct = 0
        for i, name in held:
            scores = {}
            for guess in colours:
                line = json.dumps(chat(i, guess))
                example = reader.example(line, tmp_path / "held.jsonl", 1)
                images = trainer.processor(example.images)
                with torch.no_grad():
                    scores[guess] = -float(model(torch.tensor([example.ids]), images.pixel_values, images.grid_thw,
                                                 labels=torch.tensor([example.labels])).loss)
            correct += max(scores, key=scores.get) == name
        model.train()
        return correct / len(held)

    majority = max(sum(n == c for _, n in held) for c in colours) / len(held)
    before = accuracy()
    trainer.train()
    after = accuracy()
    assert before < majority + 0.15 and after > majority + 0.4, (before, after, majority)
