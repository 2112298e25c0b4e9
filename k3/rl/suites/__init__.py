"""Built-in task suites, each a generator of tasks with a train and a held-out split, and a solver that
writes demonstrations.

    calc    arithmetic and string puzzles, solved by calling python and submitting its output
    arith   calc's arithmetic alone, with the expression also in /work/expr.txt (`Compute 17*23-5 (it is in
            /work/expr.txt).`): the solver's code evaluates the file, the same code for every task, and submits
            the output; some 290,000 distinct training prompts, none repeated by chance as calc's 30 common
            words repeat its string puzzles
    fix     a small repository with a one-line bug and a failing test; reward = the hidden tests pass
    files   find / grep / count questions over a generated directory tree
    browse  multi-hop questions over the offline web of Python's docs (k3.sandbox.web), answered with the web
            tools search / open / find

``get_suite(name)`` returns the suite; ``suite.tasks(split, count, start=0)`` the tasks (the same index gives
the same task on every machine); ``suite.solution(task)`` the solver's tool calls [(name, arguments)].
A task belongs to exactly one split: the split is decided by a hash of the task's prompt, so no held-out
prompt is ever a training prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Callable

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


def _registry() -> dict[str, Callable[[], Suite]]:
    from k3.rl.suites.browse import BrowseSuite
    from k3.rl.suites.calc import CalcSuite
    from k3.rl.suites.files import FilesSuite
    from k3.rl.suites.fix import FixSuite

    return {"calc": CalcSuite, "arith": lambda: CalcSuite(kinds=("arith_file",), name="arith"), "fix": FixSuite,
            "files": FilesSuite, "browse": BrowseSuite}


SUITE_NAMES = ("calc", "arith", "fix", "files", "browse")


def get_suite(name: str) -> Suite:
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown built-in suite {name!r}; built-in suites are {sorted(registry)} (or give a path "
                         f"to a .jsonl file or a directory of task files)")
    return registry[name]()
