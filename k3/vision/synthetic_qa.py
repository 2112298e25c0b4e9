"""A synthetic visual question-answering set, rendered locally (no download): shapes, colours, counts, positions.

    qa = SyntheticVQA(seed=0)
    sample = qa.sample(rng)              # VQASample(image=PIL image, question="what colour ?", answer="red", kind=...)
    qa.write_jsonl("data/vqa", 1000)     # {"text": "<image> what colour ? red", "images": ["000000.png"], ...}

Question kinds, each answerable from the picture alone:
    colour    one shape; its colour (6 choices)
    shape     one shape; circle, square or triangle (3)
    count     1-4 shapes of one colour; how many (4)
    position  one shape in the left or right half, upper or lower half (4)
`chance` gives the accuracy of uniform guessing and of always answering the most frequent answer per kind.
Words map to token ids through `vocab` (one id per word; `<image>` is the media placeholder).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20),
           "purple": (140, 40, 170), "orange": (240, 130, 20)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("upper-left", "upper-right", "lower-left", "lower-right")
KINDS = {"colour": tuple(COLOURS), "shape": SHAPES, "count": ("1", "2", "3", "4"), "position": POSITIONS}
QUESTIONS = {"colour": "what colour ?", "shape": "what shape ?", "count": "how many ?", "position": "where ?"}
SPECIAL = ("<pad>", "<bos>", "<image>", "<eos>")


@dataclass
class VQASample:
    image: object  # PIL.Image.Image, RGB
    question: str
    answer: str
    kind: str


class SyntheticVQA:
    def __init__(self, size: int = 112, seed: int = 0) -> None:
        self.size, self.seed = size, seed
        words = list(SPECIAL)
        for kind, question in QUESTIONS.items():
            words += [w for w in question.split() if w not in words]
            words += [a for a in KINDS[kind] if a not in words]
        self.vocab = {word: i for i, word in enumerate(words)}
        self.media_token_id = self.vocab["<image>"]

    # --- drawing ------------------------------------------------------------------------------
    def _draw(self, draw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, int, int]) -> None:
        x0, y0, x1, y1 = box
        if shape == "circle":
            draw.ellipse(box, fill=colour)
        elif shape == "square":
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)

    def _free_boxes(self, rng: random.Random, count: int, extent: int) -> list[tuple[int, int, int, int]]:
        """`count` non-overlapping square boxes of side `extent` inside the canvas (rejection sampling)."""
        boxes: list[tuple[int, int, int, int]] = []
        while len(boxes) < count:
            x, y = rng.randrange(2, self.size - extent - 2), rng.randrange(2, self.size - extent - 2)
            box = (x, y, x + extent, y + extent)
            if all(x + extent + 3 < b[0] or b[2] + 3 < x or y + extent + 3 < b[1] or b[3] + 3 < y for b in boxes):
                boxes.append(box)
        return boxes

    def sample(self, rng: random.Random, kind: str | None = None) -> VQASample:
        from PIL import Image, ImageDraw

        kind = kind or rng.choice(list(KINDS))
        background = tuple(rng.randrange(225, 256) for _ in range(3))
        image = Image.new("RGB", (self.size, self.size), background)
        draw = ImageDraw.Draw(image)
        colour = rng.choice(list(COLOURS))
        shape = rng.choice(SHAPES)
        half = self.size // 2
        if kind == "count":
            count = rng.randrange(1, 5)
            for box in self._free_boxes(rng, count, self.size // 6):
                self._draw(draw, rng.choice(SHAPES), box, COLOURS[colour])
            answer = str(count)
        else:
            extent = rng.randrange(self.size // 4, half - 3)  # fits a quadrant, so one size serves every kind
            if kind == "position":
                quadrant = rng.randrange(4)
                x0 = rng.randrange(2, half - extent - 1) + (half if quadrant % 2 else 0)
                y0 = rng.randrange(2, half - extent - 1) + (half if quadrant >= 2 else 0)
                answer = POSITIONS[quadrant]
            else:
                x0, y0 = rng.randrange(2, self.size - extent - 2), rng.randrange(2, self.size - extent - 2)
                answer = colour if kind == "colour" else shape
            self._draw(draw, shape, (x0, y0, x0 + extent, y0 + extent), COLOURS[colour])
        return VQASample(image, QUESTIONS[kind], answer, kind)

    # --- tokens -------------------------------------------------------------------------------
    def prompt_ids(self, sample: VQASample, image_tokens: int) -> list[int]:
        """<bos> <image> x image_tokens, then the question's words; the answer is the next token."""
        return ([self.vocab["<bos>"]] + [self.media_token_id] * image_tokens
                + [self.vocab[w] for w in sample.question.split()])

    def answer_id(self, sample: VQASample) -> int:
        return self.vocab[sample.answer]

    def answer_ids(self, kind: str) -> list[int]:
        return [self.vocab[a] for a in KINDS[kind]]

    @staticmethod
    def chance(samples: list[VQASample]) -> dict[str, float]:
        """Accuracy of uniform guessing among each kind's answers, and of the most frequent answer per kind."""
        uniform = sum(1 / len(KINDS[s.kind]) for s in samples) / len(samples)
        majority = 0
        for kind in KINDS:
            answers = [s.answer for s in samples if s.kind == kind]
            if answers:
                majority += max(answers.count(a) for a in set(answers))
        return {"uniform": uniform, "majority": majority / len(samples)}

    # --- files --------------------------------------------------------------------------------
    def write_jsonl(self, directory: str | Path, count: int, seed: int | None = None) -> Path:
        """`count` samples as PNGs plus data.jsonl ({"text": "<image> question answer", "images": [png],
        "question", "answer", "kind"}); returns the JSONL path."""
        from k3.atomic import atomic_write_bytes

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        rng = random.Random(self.seed if seed is None else seed)
        lines = []
        for i in range(count):
            sample = self.sample(rng)
            name = f"{i:06d}.png"
            sample.image.save(directory / name)
            lines.append(json.dumps({"text": f"<image> {sample.question} {sample.answer}", "images": [name],
                                     "question": sample.question, "answer": sample.answer, "kind": sample.kind}))
        path = directory / "data.jsonl"
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
        return path
