"""Synthetic long-context tasks, generated on the fly at any length with the tokenizer of the model.

Every task builds an `Example`: one token sequence of about `length` tokens (the prompt, then the answer)
and the spans of the answer tokens inside it. The answer is always recoverable from the input: the answer's
token ids appear verbatim earlier in the sequence (needles, variables) or follow from counting it (common
words). Prompts are assembled from separately encoded pieces, so the ids of a value in the context and in
the answer are the same ids, whatever merges the tokenizer would make across piece boundaries.

Tasks (RULER-style, plus the Zoology recall task):
    mqar               multi-query associative recall at the token level (k3.data.synthetic.RecallTask ids;
                       what `k3 train --recall-fraction` trains); every query is one answer
    needle_single      one "special magic number" sentence hidden in filler text; asked at the end
    needle_multikey    four needles with different keys; one of them asked
    needle_multivalue  four needles with the same key and different values; all asked, in order
    variable_tracking  a chain of assignments (VAR A = 12345, VAR B = A, ...) scattered in filler; every
                       variable holding the value asked, in chain order
    common_words       a list of words in which three appear most often; asked in order of frequency

Filler comes from a `Filler`: windows of a token stream (a run's held-out split), or a repeated neutral text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from k3.data.synthetic import RecallTask

# A neutral filler when no corpus is given (the "haystack" text RULER uses, in spirit).
DEFAULT_FILLER_TEXT = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
                       "again. ")
KEY_WORDS = ("amber", "basil", "cedar", "delta", "ember", "fable", "garnet", "harbor", "ivory", "jasper",
             "kernel", "lantern", "meadow", "nectar", "orchid", "pepper", "quartz", "raven", "saffron",
             "timber", "umber", "velvet", "willow", "xenon", "yarrow", "zephyr")
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")


@dataclass
class Example:
    """ids: the whole sequence (prompt then answers), answer_spans: [start, end) of every answer in ids.
    A task with one answer at the end is a prompt (ids[:start]) to complete; several spans are scored in
    place (teacher-forced: each answer token must be the argmax given the true prefix)."""

    ids: list[int]
    answer_spans: list[tuple[int, int]]
    meta: dict = field(default_factory=dict)

    @property
    def single_final_answer(self) -> bool:
        return len(self.answer_spans) == 1 and self.answer_spans[0][1] == len(self.ids)

    def answer(self, index: int = 0) -> list[int]:
        start, end = self.answer_spans[index]
        return self.ids[start:end]


class Filler:
    """Token windows of filler text: random windows of `stream` (EOS removed), or `text` repeated."""

    def __init__(self, tokenizer, stream: np.ndarray | None = None, text: str = DEFAULT_FILLER_TEXT) -> None:
        if stream is not None:
            stream = np.asarray(stream, dtype=np.int64)
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is not None:
                stream = stream[stream != eos]
        if stream is None or len(stream) == 0:
            unit = np.asarray(tokenizer.encode(text), dtype=np.int64)
            if len(unit) == 0:
                raise ValueError("the filler text encodes to no tokens")
            stream = unit
            self.random_offset = False
        else:
            self.random_offset = True
        self.stream = stream

    def take(self, count: int, rng: np.random.Generator) -> list[int]:
        if count <= 0:
            return []
        stream = self.stream
        if len(stream) < count + 1:
            stream = np.tile(stream, count // len(stream) + 2)
        start = int(rng.integers(0, len(stream) - count)) if self.random_offset else 0
        return stream[start:start + count].tolist()


class Pieces:
    """Builds a sequence from encoded pieces, remembering where chosen pieces land."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        if text not in self._cache:
            ids = self.tokenizer.encode(text)
            if not ids:
                raise ValueError(f"the tokenizer encodes {text!r} to no tokens")
            self._cache[text] = ids
        return self._cache[text]

    def add(self, piece: str | list[int]) -> tuple[int, int]:
        ids = self.encode(piece) if isinstance(piece, str) else piece
        start = len(self.ids)
        self.ids.extend(ids)
        return start, len(self.ids)


@dataclass
class TaskContext:
    tokenizer: object
    vocab_size: int
    filler: Filler
    mqar: RecallTask | None = None  # MQAR's id layout; by default derived from vocab_size


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _key(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        key = f"{KEY_WORDS[int(rng.integers(len(KEY_WORDS)))]}-{KEY_WORDS[int(rng.integers(len(KEY_WORDS)))]}"
        if key not in taken:
            taken.add(key)
            return key


def _with_filler(ctx: TaskContext, length: int, rng: np.random.Generator, inserts: list[list[int]],
                 tail: list[int], answer: list[list[int]], task: str) -> Example:
    """filler with `inserts` at sorted random depths, then `tail` (the question), then the answer pieces."""
    fixed = sum(map(len, inserts)) + len(tail) + sum(map(len, answer))
    room = length - fixed
    if room < 0:
        raise ValueError(f"{task} needs at least {fixed} tokens with this tokenizer; length {length} is too short")
    filler = ctx.filler.take(room, rng)
    cuts = np.sort(rng.integers(0, room + 1, len(inserts)))
    ids: list[int] = []
    previous = 0
    for cut, piece in zip(cuts, inserts):
        ids.extend(filler[previous:cut])
        ids.extend(piece)
        previous = int(cut)
    ids.extend(filler[previous:])
    ids.extend(tail)
    start = len(ids)
    for piece in answer:
        ids.extend(piece)
    return Example(ids, [(start, len(ids))])


def needle_task(ctx: TaskContext, length: int, rng: np.random.Generator, num_keys: int = 1,
                num_values: int = 1, task: str = "needle_single") -> Example:
    """Needles "The special magic number for KEY is VALUE." in filler; the question asks one key's values."""
    pieces = Pieces(ctx.tokenizer)
    taken: set[str] = set()
    keys = [_key(rng, taken) for _ in range(num_keys)]
    asked = keys[int(rng.integers(len(keys)))]
    inserts, answer, values_of_asked = [], [], []
    for key in keys:
        for _ in range(num_values if key == asked else 1):
            value = pieces.encode(f" {_number(rng)}")
            inserts.append(pieces.encode(f" The special magic number for {key} is") + value + pieces.encode("."))
            if key == asked:
                values_of_asked.append(value)
    if num_values == 1:
        tail = pieces.encode(f"\nWhat is the special magic number for {asked} mentioned in the text? "
                             f"The special magic number for {asked} is")
        answer = [values_of_asked[0]]
    else:
        tail = pieces.encode(f"\nWhat are all the special magic numbers for {asked} mentioned in the text? "
                             f"The special magic numbers for {asked} are")
        for i, value in enumerate(values_of_asked):
            answer.append(value if i == 0 else pieces.encode(",") + value)
    # Needles land in list order (the cuts are sorted), so the asked values appear in answer order.
    example = _with_filler(ctx, length, rng, inserts, tail, answer, task)
    example.meta = {"key": asked, "values": [ctx.tokenizer.decode(v).strip() for v in values_of_asked]}
    return example


def variable_tracking_task(ctx: TaskContext, length: int, rng: np.random.Generator, hops: int = 4) -> Example:
    """VAR X1 = 12345. VAR X2 = X1. ... scattered in order through filler; asked: every variable whose value
    is 12345, in chain order."""
    pieces = Pieces(ctx.tokenizer)
    names: list[str] = []
    while len(names) < hops:
        name = "".join(chr(ord("A") + int(c)) for c in rng.integers(0, 26, 5))
        if name not in names:
            names.append(name)
    value = _number(rng)[:5]
    inserts = [pieces.encode(" VAR") + pieces.encode(f" {names[0]}") + pieces.encode(" =")
               + pieces.encode(f" {value}") + pieces.encode(".")]
    for previous, name in zip(names, names[1:]):
        inserts.append(pieces.encode(" VAR") + pieces.encode(f" {name}") + pieces.encode(" =")
                       + pieces.encode(f" {previous}") + pieces.encode("."))
    tail = pieces.encode(f"\nQuestion: Find all variables that are assigned the value {value} in the text "
                         f"above. Answer: the {hops} variables assigned the value {value} are")
    answer = [pieces.encode(f" {name}") for name in names]
    example = _with_filler(ctx, length, rng, inserts, tail, answer, "variable_tracking")
    example.meta = {"value": value, "names": names}
    return example


def _pseudo_word(rng: np.random.Generator) -> str:
    return "".join(SYLLABLES[int(i)] for i in rng.integers(0, len(SYLLABLES), 3))


def common_words_task(ctx: TaskContext, length: int, rng: np.random.Generator, top: int = 3) -> Example:
    """A list of words in which `top` words appear most often (distinct counts, so the order is defined) and
    every other word at most twice; asked: the `top` words in order of frequency."""
    pieces = Pieces(ctx.tokenizer)
    tail = pieces.encode(f"\nQuestion: What are the {top} most common words in the list above? Answer: the "
                         f"{top} words that appear most often are")
    probe = [pieces.encode(f" {_pseudo_word(rng)}") for _ in range(32)]
    per_word = sum(map(len, probe)) / len(probe)
    budget = length - len(tail) - top * int(np.ceil(per_word))
    words_total = max(int(budget / per_word), top * 6)
    # The common words take about a fifth of the list: counts c, c-1, ... all above the others' 2.
    common_count = max(3 + top, words_total // (5 * top))
    common: list[str] = []
    while len(common) < top:
        word = _pseudo_word(rng)
        if word not in common:
            common.append(word)
    counts = {word: common_count - i for i, word in enumerate(common)}
    words = [w for w, c in counts.items() for _ in range(c)]
    seen = set(common)
    rare_count: dict[str, int] = {}
    used = sum(len(pieces.encode(f" {w}")) for w in words)
    answer = [pieces.encode(f" {w}") for w in common]
    room = length - len(tail) - sum(map(len, answer))
    if used > room:
        raise ValueError(f"common_words needs more than {used + length - room} tokens; length {length} is too short")
    while True:
        word = _pseudo_word(rng)
        if word in seen and rare_count.get(word, 0) >= 2 or word in common:
            continue
        cost = len(pieces.encode(f" {word}"))
        if used + cost > room:
            break
        rare_count[word] = rare_count.get(word, 0) + 1
        seen.add(word)
        words.append(word)
        used += cost
    order = rng.permutation(len(words))
    ids: list[int] = []
    for i in order:
        ids.extend(pieces.encode(f" {words[i]}"))
    # Pad to the length with filler before the list (never inside it, where it could add words).
    ids = ctx.filler.take(room - used, rng) + ids
    ids.extend(tail)
    start = len(ids)
    for piece in answer:
        ids.extend(piece)
    return Example(ids, [(start, len(ids))], {"common": common, "counts": [counts[w] for w in common]})


def mqar_task(ctx: TaskContext, length: int, rng: np.random.Generator) -> Example:
    """RecallTask ids: pairs, filler, queries; every query's answer is a one-token span."""
    task = ctx.mqar or RecallTask(ctx.vocab_size)
    ids, labels = task.sample(length, rng)
    spans = [(int(p) + 1, int(p) + 2) for p in np.flatnonzero(labels != -100)]
    return Example(ids.tolist(), spans, {"pairs": task.num_pairs})


TASKS: dict[str, Callable[[TaskContext, int, np.random.Generator], Example]] = {
    "mqar": mqar_task,
    "needle_single": lambda ctx, n, rng: needle_task(ctx, n, rng, 1, 1, "needle_single"),
    "needle_multikey": lambda ctx, n, rng: needle_task(ctx, n, rng, 4, 1, "needle_multikey"),
    "needle_multivalue": lambda ctx, n, rng: needle_task(ctx, n, rng, 1, 4, "needle_multivalue"),
    "variable_tracking": variable_tracking_task,
    "common_words": common_words_task,
}


def make_examples(task: str, ctx: TaskContext, length: int, count: int, seed: int = 0) -> list[Example]:
    """`count` examples of `task` at `length` tokens, reproducible from (seed, task, length)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    rng = np.random.default_rng([seed, sorted(TASKS).index(task), length])
    return [TASKS[task](ctx, length, rng) for _ in range(count)]
