"""`k3 eval --task vqa ocr` on a model with a vision tower: held-out items are reproducible, rows have the keys of
the text tasks' rows, a text-only model is refused with a clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

from k3.cli import main  # noqa: E402
from k3.eval.visual import visual_items  # noqa: E402
from k3.vision.demo import DemoSettings, build_model  # noqa: E402
from k3.vision.synthetic_qa import SyntheticVQA  # noqa: E402

TINY_TOWER = dict(vision_width=32, vision_layers=1, vision_heads=2, vision_head_dim=16)


@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory):
    """A random tiny K3ForConditionalGeneration in the published layout, with the demo's word tokenizer."""
    from k3.checkpoint.hf_multimodal import save_pretrained

    qa = SyntheticVQA(size=112)
    torch.manual_seed(0)
    model = build_model(DemoSettings(**TINY_TOWER), qa)
    path = tmp_path_factory.mktemp("tiny-vlm")
    save_pretrained(model, qa.tokenizer(), path, progress=False)
    return path


def test_visual_items_are_reproducible_and_balanced():
    tokenizer = SyntheticVQA().tokenizer()
    a = visual_items("vqa", tokenizer, 2, 16, 12, seed=3, image_size=112)
    b = visual_items("vqa", tokenizer, 2, 16, 12, seed=3, image_size=112)
    c = visual_items("vqa", tokenizer, 2, 16, 12, seed=4, image_size=112)
    assert [(i.prompt, i.answer) for i in a] == [(i.prompt, i.answer) for i in b]
    assert all(np.array_equal(np.asarray(x.image), np.asarray(y.image)) for x, y in zip(a, b))
    assert [(i.prompt, i.answer) for i in a] != [(i.prompt, i.answer) for i in c]
    assert [i.kind for i in a] == ["colour", "shape", "count", "position"] * 3
    # <bos>, 16 placeholders, the question; the answer ends with <eos>.
    assert all(i.prompt[0] == tokenizer.bos_token_id and i.prompt[1:17] == [2] * 16 for i in a)
    assert all(i.answer[-1] == tokenizer.eos_token_id for i in a)
    ocr = visual_items("ocr", tokenizer, 2, 16, 4, seed=3, image_size=112)
    assert {i.kind for i in ocr} == {"text"} and all(len(i.answer) == 4 for i in ocr)  # three letters + <eos>


def test_vqa_rows_have_the_keys_of_the_text_tasks(tiny_vlm_dir, tmp_path, capsys):
    rows_path = tmp_path / "rows.json"
    assert main(["eval", "--model", str(tiny_vlm_dir), "--task", "vqa", "ocr", "needle_single", "--lengths", "128",
                 "--n", "8", "--json", str(rows_path), "--quiet"]) == 0
    rows = json.loads(rows_path.read_text())
    text_keys = [set(r) for r in rows if r["task"] == "needle_single"]
    assert text_keys == [{"task", "length", "accuracy", "n", "seconds", "peak_gib"}]
    assert all(set(r) == text_keys[0] and 0 <= r["accuracy"] <= 1 for r in rows)
    by_task = {r["task"]: r for r in rows}
    assert set(by_task) == {"needle_single", "vqa", "vqa/colour", "vqa/shape", "vqa/count", "vqa/position", "ocr"}
    assert by_task["vqa"]["n"] == by_task["ocr"]["n"] == 8
    assert sum(by_task[f"vqa/{k}"]["n"] for k in ("colour", "shape", "count", "position")) == 8
    assert by_task["vqa"]["length"] == by_task["ocr"]["length"] == 84  # the image side: 6x6 grid x 14 px
    assert "vqa/shape" in capsys.readouterr().out


def test_visual_tasks_on_a_text_only_model_say_what_is_missing(tmp_path, capsys):
    from k3.checkpoint.hf_save import save_pretrained
    from k3.config import ModelConfig
    from k3.model import K3ForCausalLM

    qa = SyntheticVQA()
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=64))
    save_pretrained(model, qa.tokenizer(), tmp_path / "text", progress=False)
    assert main(["eval", "--model", str(tmp_path / "text"), "--task", "vqa", "--n", "2", "--quiet"]) == 1
    assert "vision tower" in capsys.readouterr().err


def test_engine_answers_equal_the_full_forward(tiny_vlm_dir):
    """The engine's first greedy token after an image prompt is the argmax of the uncached multimodal forward."""
    from k3.eval.visual import visual_generate
    from k3.infer.engine import Engine
    from k3.checkpoint.hf_multimodal import from_pretrained
    from k3.vision.processing import ImageProcessor

    model = from_pretrained(tiny_vlm_dir, progress=False)
    tokenizer = SyntheticVQA().tokenizer()
    items = visual_items("vqa", tokenizer, model.media_token_id, 9, 6, seed=0, image_size=84)
    engine = Engine(model.language_model, tokenizer, max_context=32, max_batch=4, prefix_cache=False)
    generated = visual_generate(model, engine, items)
    processor = ImageProcessor.for_vision(model.vision.config, max_patches=36)
    with torch.no_grad():
        for item, out in zip(items, generated):
            batch = processor([item.image])
            logits = model(torch.tensor([item.prompt]), batch.pixel_values, batch.grid_thw).logits[0, -1]
            assert out[0] == int(logits.argmax())
            # The answer's length, or shorter where the engine stopped at <eos> (then a wrong answer).
            assert len(out) == len(item.answer) or (len(out) < len(item.answer) and out[-1] == tokenizer.eos_token_id)
