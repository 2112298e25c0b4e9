"""The synthetic visual QA set: answers are visible in the pictures, files in the image-text JSONL format, and
(slow) a tiny vision-language model trained on it on CPU answers held-out questions far above chance."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

pytest.importorskip("PIL")

from k3.vision.synthetic_qa import COLOURS, KINDS, POSITIONS, SyntheticVQA  # noqa: E402


def test_answers_are_visible_in_the_image():
    qa, rng = SyntheticVQA(), random.Random(3)
    for _ in range(40):
        sample = qa.sample(rng)
        pixels = np.asarray(sample.image).astype(int)
        assert sample.answer in KINDS[sample.kind]
        if sample.kind == "colour":
            colour = np.array(COLOURS[sample.answer])
            assert (np.abs(pixels - colour).sum(-1) == 0).sum() > 50
        if sample.kind == "position":
            ys, xs = np.nonzero((pixels < 200).any(-1) & (np.abs(pixels - pixels[0, 0]).sum(-1) > 30))
            quadrant = POSITIONS.index(sample.answer)
            half = qa.size // 2
            assert ((xs >= half) == bool(quadrant % 2)).all() and ((ys >= half) == (quadrant >= 2)).all()


def test_same_seed_same_samples_and_chance():
    a = [SyntheticVQA().sample(random.Random(5)) for _ in range(3)]
    b = [SyntheticVQA().sample(random.Random(5)) for _ in range(3)]
    assert [(s.question, s.answer) for s in a] == [(s.question, s.answer) for s in b]
    assert np.array_equal(np.asarray(a[0].image), np.asarray(b[0].image))
    rng = random.Random(0)
    samples = [SyntheticVQA().sample(rng) for _ in range(400)]
    chance = SyntheticVQA.chance(samples)
    assert 0.2 < chance["uniform"] < 0.35 and chance["majority"] < 0.45


def test_jsonl_has_the_image_text_format(tmp_path):
    path = SyntheticVQA().write_jsonl(tmp_path, 5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5
    for row in rows:
        assert row["text"].startswith("<image> ") and row["text"].endswith(row["answer"])
        assert (tmp_path / row["images"][0]).is_file()


@pytest.mark.slow
def test_tiny_vlm_learns_the_synthetic_qa_far_above_chance():
    from k3.vision.train_vqa import train_vqa

    report = train_vqa(eval_count=512, progress=False)  # 1500 steps: 8 min on a busy 2-core machine
    print(json.dumps(report, indent=1))
    assert report["accuracy"] > report["chance"]["majority"] + 0.25, report
