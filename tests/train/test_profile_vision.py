"""`k3 train --profile` on image-text data splits the step between the vision tower (+ projector) and the
language model; the split's premise (autograd runs the tower's backward after the language model's) holds."""

import json
import time
from pathlib import Path

import pytest
import torch

from k3.config import ModelConfig
from k3.multimodal import K3ForConditionalGeneration
from k3.train.profile import PROFILE_STEPS, VisionSplit
from k3.train.trainer import Trainer
from k3.vision.config import VisionConfig

Image = pytest.importorskip("PIL.Image")


def test_the_towers_backward_runs_after_the_language_models():
    text = ModelConfig.from_preset("debug", vocab_size=64, num_layers=2, full_attn_layers=[2])
    vision = VisionConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, head_dim=16,
                          pos_emb_height=4, pos_emb_width=4, text_hidden_size=text.hidden_size)
    model = K3ForConditionalGeneration(text, vision, media_token_id=3)
    split = VisionSplit(torch.device("cpu"))
    split.active = True
    ids = torch.tensor([[1] + [3] * 4 + [5, 6, 7]])
    pixels = torch.randn(16, 3, 14, 14, requires_grad=True)
    grid = torch.tensor([[1, 4, 4]])
    stamps = {}
    split.start()
    with split.vision_forward():
        image_embeds = model.vision(pixels, grid)
    split.watch(image_embeds)
    embeds = model.embed_multimodal(ids, image_embeds=image_embeds)
    # the language model's input has its whole gradient once the language model's backward is over; the
    # pixels have theirs at the end of the tower's
    embeds.register_hook(lambda grad: stamps.update(language_model_done=time.perf_counter()))
    pixels.register_hook(lambda grad: stamps.update(tower_done=time.perf_counter()))
    model.language_model(None, inputs_embeds=embeds, labels=torch.tensor([[-100] * 5 + [6, 7, -100]])).loss.backward()
    split.backward_done()
    assert stamps["language_model_done"] < split._marks["vision_backward"] < stamps["tower_done"]
    step = split.steps[0]
    assert step["vision_forward"] > 0 and step["vision_backward"] > 0 and step["language_model"] > 0
    assert step["vision_forward"] + step["vision_backward"] + step["language_model"] == pytest.approx(
        step["forward_backward"])


def test_a_profiled_image_run_reports_the_towers_and_the_language_models_share(tmp_path, corpus_dir, small_config):
    folder = tmp_path / "images"
    folder.mkdir()
    records = []
    for i in range(6):
        Image.new("RGB", (28 * (1 + i % 3), 28), (40 * i, 0, 255 - 40 * i)).save(folder / f"{i}.png")
        records.append({"text": f"a <image> number {i}", "images": [f"{i}.png"]})
    (folder / "mm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # The window from the first step (--profile-at 1) and a 2-layer model: the profiler's events of the window,
    # which the report parses, are most of the test's time, and the split is the same at any step and depth.
    steps = PROFILE_STEPS
    config = small_config(tmp_path / "run", corpus_dir, data=[str(corpus_dir), str(folder / "mm.jsonl")],
                          recall_fraction=0.0, batch_size=2, seq_len=64, max_steps=steps, eval_every=steps,
                          val_fraction=0.01, model_overrides={"vocab_size": 320, "num_layers": 2,
                                                             "full_attn_layers": [2]})
    summary = Trainer(config, show_progress=False, profile=tmp_path / "prof", profile_at=1).train()
    report = Path(summary["profile"])
    split = json.loads(report.with_suffix(".json").read_text())
    assert split["vision_forward_ms"] > 0 and split["vision_backward_ms"] > 0 and split["language_model_ms"] > 0
    total = split["vision_forward_ms"] + split["vision_backward_ms"] + split["language_model_ms"] + split["other_ms"]
    assert total == pytest.approx(split["wall_ms"], rel=1e-6)
    assert "vision tower + projector per step: forward" in report.read_text()
