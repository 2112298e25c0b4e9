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

from typing import Callable

# The base class lives in base.py, below the suites that subclass it, so the package imports them (by name, in
# the registry) and they never import the package back; re-exported.
from k3.rl.suites.base import HELDOUT_BUCKETS, Suite, prompt_split  # noqa: F401


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
