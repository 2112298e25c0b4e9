"""fix: a small repository (/work/repo) with a one-line bug; its visible test fails. Reward 1 when the
hidden tests (written only at verification time, never visible during the episode) pass."""

from __future__ import annotations

import random

from k3.rl.suites.base import Suite
from k3.rl.tasks import EpisodeLimits, Task, Verifier

LIMITS = EpisodeLimits(turns=8, tokens_per_turn=160, total_tokens=2048, seconds=120.0)
REPO = "/work/repo"

# name -> (source lines, the line a bug may replace, buggy variants, visible asserts, hidden asserts)
FUNCTIONS: dict[str, tuple[str, str, list[str], list[str], list[str]]] = {
    "add": ("def add(a, b):\n    return a + b\n", "    return a + b", ["    return a - b", "    return a * b"],
            ["add(2, 3) == 5"], ["add(-1, 1) == 0", "add(10, 5) == 15"]),
    "is_even": ("def is_even(n):\n    return n % 2 == 0\n", "    return n % 2 == 0",
                ["    return n % 2 == 1", "    return n % 3 == 0"], ["is_even(4)", "not is_even(7)"],
                ["is_even(0)", "not is_even(-3)", "is_even(10)"]),
    "clamp": ("def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n", "    return max(lo, min(x, hi))",
              ["    return min(lo, max(x, hi))", "    return max(lo, min(x, lo))"], ["clamp(5, 0, 3) == 3"],
              ["clamp(-2, 0, 3) == 0", "clamp(2, 0, 3) == 2"]),
    "last": ("def last(items):\n    return items[-1]\n", "    return items[-1]", ["    return items[0]",
             "    return items[-2]"], ["last([1, 2, 3]) == 3"], ["last(['a', 'b']) == 'b'", "last([7]) == 7"]),
    "mean": ("def mean(values):\n    return sum(values) / len(values)\n", "    return sum(values) / len(values)",
             ["    return sum(values) / (len(values) + 1)", "    return sum(values) // len(values)"],
             ["mean([1, 2, 3, 4]) == 2.5"], ["mean([5]) == 5", "mean([1, 2]) == 1.5"]),
    "count_vowels": ("def count_vowels(text):\n    return sum(1 for c in text if c in 'aeiou')\n",
                     "    return sum(1 for c in text if c in 'aeiou')",
                     ["    return sum(1 for c in text if c in 'aeio')",
                      "    return sum(1 for c in text if c not in 'aeiou')"],
                     ["count_vowels('queue') == 4"], ["count_vowels('sky') == 0", "count_vowels('banana') == 3"]),
    "square": ("def square(x):\n    return x * x\n", "    return x * x", ["    return x + x", "    return x * 2"],
               ["square(3) == 9"], ["square(-4) == 16", "square(0) == 0", "square(1) == 1"]),
    "largest": ("def largest(values):\n    return max(values)\n", "    return max(values)",
                ["    return min(values)", "    return values[0]"], ["largest([3, 9, 2]) == 9"],
                ["largest([-5, -2]) == -2", "largest([4]) == 4"]),
}


def _tests(names: list[str], kind: int) -> str:
    lines = [f"from lib import {', '.join(names)}", ""]
    for name in names:
        for check in FUNCTIONS[name][kind]:
            lines.append(f"assert {check}, {check!r}")
    lines.append("print('all tests passed')")
    return "\n".join(lines) + "\n"


class FixSuite(Suite):
    name = "fix"
    system = ("Fix the bug in /work/repo so its tests pass. Run the tests with bash, read and edit files, then "
              "submit.")

    def make(self, rng: random.Random, index: int) -> Task:
        names = rng.sample(sorted(FUNCTIONS), rng.randint(3, 5))
        buggy = rng.choice(names)
        source, good_line, variants, _, _ = FUNCTIONS[buggy]
        bad_line = rng.choice(variants)
        module = "\n\n".join(FUNCTIONS[n][0].replace(good_line, bad_line) if n == buggy else FUNCTIONS[n][0]
                             for n in names)
        files = {f"{REPO}/lib.py": module, f"{REPO}/test_lib.py": _tests(names, 3)}
        hidden = {f"{REPO}/.hidden_test.py": _tests(names, 3).replace("print('all tests passed')\n", "")
                  + _tests(names, 4).split("\n", 2)[2]}
        prompt = f"The tests in {REPO}/test_lib.py fail. Find the bug in {REPO}/lib.py and fix it."
        return Task(id="", prompt=prompt + f" (functions: {', '.join(names)})",
                    verifier=Verifier("command", command=f"cd {REPO} && python3 .hidden_test.py", files=hidden,
                                      timeout=30.0),
                    system=self.system, files=files, limits=LIMITS,
                    meta={"buggy": buggy, "bad_line": bad_line, "good_line": good_line})

    def solution(self, task: Task) -> list[tuple[str, dict]]:
        return [("bash", {"command": f"cd {REPO} && python3 test_lib.py"}),
                ("read_file", {"path": f"{REPO}/lib.py"}),
                ("edit", {"path": f"{REPO}/lib.py", "old": task.meta["bad_line"], "new": task.meta["good_line"]}),
                ("bash", {"command": f"cd {REPO} && python3 test_lib.py"}),
                ("submit", {"answer": "fixed"})]
