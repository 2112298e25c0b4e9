"""The synthetic visual QA set: answers are visible in the pictures, the generator is deterministic and balanced
per kind, its word-level tokenizer matches its vocabulary, files in the image-text JSONL format."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

pytest.importorskip("PIL")

from k3.vision.synthetic_qa import COLOURS, KINDS, LETTERS, POSITIONS, TEXT_LENGTH, SyntheticVQA  # noqa: E402


def test_answers_are_visible_in_the_image():
    qa, rng = SyntheticVQA(), random.Random(3)
    for _ in range(40):
        sample = qa.sample(rng)
        pixels = np.asarray(sample.image).astype(int)
        assert set(sample.answer.split()) <= set(KINDS[sample.kind])
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
    chance = SyntheticVQA.chance(SyntheticVQA().samples(100, seed=0))
    assert {k: v["uniform"] for k, v in chance.items()} == {"colour": 1 / 6, "shape": 1 / 3, "count": 1 / 4,
                                                            "position": 1 / 4, "text": 1 / 1000}
    assert all(v["majority"] <= v["uniform"] + 0.06 for k, v in chance.items() if k != "text")


def test_the_generator_is_deterministic_and_balanced_per_kind():
    qa = SyntheticVQA(size=112)
    first, again, other = qa.samples(200, seed=4), qa.samples(200, seed=4), qa.samples(200, seed=5)
    assert [(s.kind, s.answer) for s in first] == [(s.kind, s.answer) for s in again]
    assert all(np.array_equal(np.asarray(x.image), np.asarray(y.image)) for x, y in zip(first, again))
    assert [(s.kind, s.answer) for s in first] != [(s.kind, s.answer) for s in other]
    for kind, answers in KINDS.items():
        mine = [s for s in first if s.kind == kind]
        assert len(mine) == 40
        # Each answer (for text: each first letter) within one of the others' counts.
        keys = [s.answer.split()[0] for s in mine]
        counts = [keys.count(a) for a in answers]
        assert max(counts) - min(counts) <= 1, (kind, counts)
    texts = [s for s in first if s.kind == "text"]
    assert all(len(s.answer.split()) == TEXT_LENGTH and set(s.answer.split()) <= set(LETTERS) for s in texts)


def test_text_is_rendered_and_the_tokenizer_matches_the_vocabulary(tmp_path):
    from k3.data.tokenizer import load_tokenizer

    qa = SyntheticVQA(size=112)
    sample = qa.sample(random.Random(1), "text")
    pixels = np.asarray(sample.image).astype(int)
    assert ((pixels.max(-1) < 120).sum()) > 40  # dark ink on a light background
    tokenizer = qa.tokenizer()
    tokenizer.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    ids = [qa.vocab[w] for w in sample.question.split()] + qa.answer_ids(sample)[:-1]
    assert loaded.encode(f"{sample.question} {sample.answer}") == ids
    assert loaded.eos_token_id == qa.vocab["<eos>"] and loaded.bos_token_id == qa.vocab["<bos>"]
    assert loaded.encode("<image>") == [qa.media_token_id]
    assert loaded.decode(ids) == f"{sample.question} {sample.answer}"


def test_text_pictures_hold_one_large_letter_in_each_third():
    """The OCR-like kind's letters are large beside the 14-px patches and one to a cell (smaller text at a free
    place was not learned)."""
    qa, rng = SyntheticVQA(size=84), random.Random(2)
    assert qa.max_patches(14) == 12 * 4
    for _ in range(10):
        sample = qa.sample(rng, "text")
        assert sample.image.size == (168, 56)
        ink = np.asarray(sample.image).astype(int).max(-1) < 120
        for cell in range(TEXT_LENGTH):
            rows, columns = np.nonzero(ink[:, 56 * cell: 56 * (cell + 1)])
            assert rows.max() - rows.min() + 1 >= 28  # cap height: at least 2 patches
            assert columns.min() > 0 and columns.max() < 55  # within its cell
    assert qa.sample(rng, "colour").image.size == (84, 84)


def test_jsonl_has_the_image_text_format(tmp_path):
    path = SyntheticVQA().write_jsonl(tmp_path, 5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5
    for row in rows:
        assert row["text"].startswith("<image> ") and row["text"].endswith(row["answer"])
        assert (tmp_path / row["images"][0]).is_file()
