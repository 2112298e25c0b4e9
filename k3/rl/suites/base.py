"""The base of the built-in task suites and the prompt hash that puts each task in exactly one split."""

from __future__ import annotations

import dataclasses
import hashlib
import random

from k3.rl.tasks import Task

HELDOUT_BUCKETS = 5  # one prompt in five is held out


def prompt_split(prompt: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") % HELDOUT_BUCKETS
    return "heldout" if bucket == 0 else "train"


class Suite:
    """Base of the built-in suites: ``make(rng) -> Task`` draws one task; tasks(split, count, start) draws
    until it has ``count`` tasks of ``split`` (by the prompt hash), from a seed fixed by (suite, split, index)."""

    name = "suite"
    system = ("You solve the task using tools. Call a tool by writing <tool_call>{\"name\": ..., \"arguments\": "
              "{...}}</tool_call>. Finish with submit.")

    def make(self, rng: random.Random, index: int) -> Task:
        raise NotImplementedError

    def solution(self, task: Task) -> list[tuple[str, dict]]:
        """The solver's tool calls for ``task``, in order (the last is submit)."""
        raise NotImplementedError

    def task(self, split: str, index: int) -> Task:
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        rng = random.Random(f"{self.name}/{split}/{index}")
        for _ in range(1000):
            task = self.make(rng, index)
            if prompt_split(task.prompt) == split:
                return dataclasses.replace(task, id=f"{self.name}-{split}-{index}", split=split)
        raise RuntimeError(f"suite {self.name} drew 1000 tasks without one of split {split}")

    def tasks(self, split: str, count: int, start: int = 0) -> list[Task]:
        return [self.task(split, i) for i in range(start, start + count)]
