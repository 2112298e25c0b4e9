"""A synthetic visual question-answering set, rendered locally (no download): shapes, colours, counts, positions
and short rendered text.

    qa = SyntheticVQA(size=112, seed=0)
    samples = qa.samples(500, seed=1)    # balanced: kinds in turn, each kind's answers in turn
    sample = qa.sample(rng, "shape")     # VQASample(image=PIL image, question="what shape ?", answer="circle", ...)
    qa.write_jsonl("data/vqa", 1000)     # {"text": "<image> what colour ? red", "images": ["000000.png"], ...}

Question kinds, each answerable from the picture alone:
    colour    one shape; its colour (6 choices)
    shape     one shape; circle, square or triangle (3)
    count     1-4 small shapes of one colour; how many (4)
    position  one shape in the left or right half, upper or lower half (4)
    text      three letters, one in each third of a strip picture (2 x size wide, size - 28 tall: 168 x 56 px
              at 84), each at a small random offset in its cell, large beside the 14-px patches (font = the
              strip's height: cap height ~39 px at 84, about 3 x 3 patches); the answer is the letters in
              reading order, one word each ("K A T"): 10^3 possible answers (an OCR-like task). Small text at a
              free place was not learned by the demo's model at all: docs/vision.md has the runs
`chance` gives the accuracy of uniform guessing among each kind's answers and of always answering the most
frequent one. Words map to token ids through `vocab` (one id per word; `<image>` is the media placeholder);
`tokenizer()` is the same map as a `tokenizers` word-level tokenizer that k3's loaders read.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20),
           "purple": (140, 40, 170), "orange": (240, 130, 20)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("upper-left", "upper-right", "lower-left", "lower-right")
LETTERS = tuple("ACEHKMPSTX")  # glyphs that differ clearly in the default font
TEXT_LENGTH = 3
KINDS = {"colour": tuple(COLOURS), "shape": SHAPES, "count": ("1", "2", "3", "4"), "position": POSITIONS,
         "text": LETTERS}
QUESTIONS = {"colour": "what colour ?", "shape": "what shape ?", "count": "how many ?", "position": "where ?",
             "text": "what text ?"}
SPECIAL = ("<pad>", "<bos>", "<image>", "<eos>")


def answer_space(kind: str) -> int:
    """How many different answers a kind has (text: every string of TEXT_LENGTH letters)."""
    return len(LETTERS) ** TEXT_LENGTH if kind == "text" else len(KINDS[kind])


@dataclass
class VQASample:
    image: object  # PIL.Image.Image, RGB
    question: str
    answer: str  # words separated by spaces: one word, or the letters of a text answer
    kind: str


class SyntheticVQA:
    def __init__(self, size: int = 112, seed: int = 0) -> None:
        if size < 56:
            raise ValueError(f"image size {size} is too small to draw the scenes; use at least 56 px")
        self.size, self.seed = size, seed
        self.text_size = (2 * size, size - 28)  # (width, height) of a text picture: two rows of merged tokens at 84
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

    def _font(self):
        from PIL import ImageFont

        if not hasattr(self, "_font_cache"):
            self._font_cache = ImageFont.load_default(size=self.text_size[1])
        return self._font_cache

    def sample(self, rng: random.Random, kind: str | None = None, answer: str | None = None) -> VQASample:
        """One picture and question of `kind` (random if None); `answer` fixes the answer (for text: its first
        letter)."""
        from PIL import Image, ImageDraw

        kind = kind or rng.choice(list(KINDS))
        if kind not in KINDS:
            raise ValueError(f"unknown question kind {kind!r}; choose from {list(KINDS)}")
        background = tuple(rng.randrange(225, 256) for _ in range(3))
        image = Image.new("RGB", self.text_size if kind == "text" else (self.size, self.size), background)
        draw = ImageDraw.Draw(image)
        colour = answer if kind == "colour" and answer else rng.choice(list(COLOURS))
        shape = answer if kind == "shape" and answer else rng.choice(SHAPES)
        half = self.size // 2
        if kind == "count":
            count = int(answer) if answer else rng.randrange(1, 5)
            for box in self._free_boxes(rng, count, self.size // 6):
                self._draw(draw, rng.choice(SHAPES), box, COLOURS[colour])
            answer = str(count)
        elif kind == "text":
            letters = [answer or rng.choice(LETTERS)] + [rng.choice(LETTERS) for _ in range(TEXT_LENGTH - 1)]
            font = self._font()
            ink = tuple(rng.randrange(0, 90) for _ in range(3))
            height, cell = self.text_size[1], self.text_size[0] // TEXT_LENGTH
            for i, letter in enumerate(letters):  # centred in its cell, then moved a little
                x0, y0, x1, y1 = draw.textbbox((0, 0), letter, font=font)
                x = i * cell + (cell - (x1 - x0)) // 2 - x0 + rng.randint(-(self.size // 28), self.size // 28)
                y = (height - (y1 - y0)) // 2 - y0 + rng.randint(-(self.size // 14), self.size // 14)
                draw.text((x, y), letter, fill=ink, font=font)
            answer = " ".join(letters)
        else:
            extent = rng.randrange(self.size // 4, half - 3)  # fits a quadrant, so one size serves every kind
            if kind == "position":
                quadrant = POSITIONS.index(answer) if answer else rng.randrange(4)
                x0 = rng.randrange(2, half - extent - 1) + (half if quadrant % 2 else 0)
                y0 = rng.randrange(2, half - extent - 1) + (half if quadrant >= 2 else 0)
                answer = POSITIONS[quadrant]
            else:
                x0, y0 = rng.randrange(2, self.size - extent - 2), rng.randrange(2, self.size - extent - 2)
                answer = colour if kind == "colour" else shape
            self._draw(draw, shape, (x0, y0, x0 + extent, y0 + extent), COLOURS[colour])
        return VQASample(image, QUESTIONS[kind], answer, kind)

    def stream(self, seed: int, kinds: tuple[str, ...] = tuple(KINDS)) -> Iterator[VQASample]:
        """Endless balanced samples: the kinds in turn; within a kind its answers (text: first letters) in a
        shuffled order that is redrawn after every full pass, so counts differ by at most one."""
        rng = random.Random(seed)
        pending: dict[str, list[str]] = {kind: [] for kind in kinds}
        while True:
            for kind in kinds:
                if not pending[kind]:
                    pending[kind] = list(KINDS[kind])
                    rng.shuffle(pending[kind])
                yield self.sample(rng, kind, pending[kind].pop())

    def samples(self, count: int, seed: int, kinds: tuple[str, ...] = tuple(KINDS)) -> list[VQASample]:
        stream = self.stream(seed, kinds)
        return [next(stream) for _ in range(count)]

    def max_patches(self, patch_size: int) -> int:
        """Patches of the largest picture (a text one): an ImageProcessor's budget that keeps every size."""
        return (self.text_size[0] // patch_size) * (self.text_size[1] // patch_size)

    # --- tokens -------------------------------------------------------------------------------
    def prompt_ids(self, sample: VQASample, image_tokens: int) -> list[int]:
        """<bos> <image> x image_tokens, then the question's words; the answer follows."""
        return ([self.vocab["<bos>"]] + [self.media_token_id] * image_tokens
                + [self.vocab[w] for w in sample.question.split()])

    def answer_ids(self, sample: VQASample) -> list[int]:
        """The answer's words, then <eos>."""
        return [self.vocab[w] for w in sample.answer.split()] + [self.vocab["<eos>"]]

    def tokenizer(self):
        """The vocabulary as a word-level `tokenizers` tokenizer (split on spaces), wrapped in k3's interface;
        `save(directory)` writes tokenizer.json for k3.load_tokenizer / the HF loader."""
        from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

        from k3.data.tokenizer import BPETokenizer

        backend = Tokenizer(models.WordLevel(self.vocab, unk_token="<pad>"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
        return BPETokenizer(backend, eos_token="<eos>", bos_token="<bos>")

    @staticmethod
    def chance(samples: list[VQASample]) -> dict[str, dict[str, float]]:
        """Per kind: accuracy of uniform guessing among the kind's answers, and of always giving its most frequent
        answer in `samples`."""
        out: dict[str, dict[str, float]] = {}
        for kind in KINDS:
            answers = [s.answer for s in samples if s.kind == kind]
            if answers:
                out[kind] = {"uniform": 1 / answer_space(kind),
                             "majority": max(answers.count(a) for a in set(answers)) / len(answers)}
        return out

    # --- files --------------------------------------------------------------------------------
    def write_jsonl(self, directory: str | Path, count: int, seed: int | None = None) -> Path:
        """`count` balanced samples as PNGs plus data.jsonl ({"text": "<image> question answer", "images": [png],
        "question", "answer", "kind"}); returns the JSONL path."""
        from k3.atomic import atomic_write_bytes

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lines = []
        for i, sample in enumerate(self.samples(count, self.seed if seed is None else seed)):
            name = f"{i:06d}.png"
            sample.image.save(directory / name)
            lines.append(json.dumps({"text": f"<image> {sample.question} {sample.answer}", "images": [name],
                                     "question": sample.question, "answer": sample.answer, "kind": sample.kind}))
        path = directory / "data.jsonl"
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
        return path
