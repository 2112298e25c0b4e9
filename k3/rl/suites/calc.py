"""calc: arithmetic and string puzzles. The model writes a short Python script, runs it with the python tool,
and submits what it printed. Reward 1 when the submitted answer equals the true one."""

from __future__ import annotations

import random
import string

from k3.rl.suites.base import Suite
from k3.rl.tasks import EpisodeLimits, Task, Verifier

LIMITS = EpisodeLimits(turns=4, tokens_per_turn=48, total_tokens=256, seconds=60.0)
WORDS = ["apple", "banana", "cherry", "delta", "echo", "falcon", "garden", "harbor", "island", "jungle",
         "kettle", "lemon", "mango", "nectar", "orbit", "pepper", "quartz", "river", "sunset", "tunnel", "cat", "dog",
         "sky", "moon", "star", "tree", "leaf", "rock", "sand", "wave"]


def _word(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(WORDS)
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))


EXPRESSION_FILE = "/work/expr.txt"
ARITH_FILE_CODE = f"print(eval(open('{EXPRESSION_FILE}').read()))"
KINDS = ("arith", "arith", "reverse", "count", "sort")  # arithmetic drawn twice as often


class CalcSuite(Suite):
    name = "calc"
    system = "Use python, then submit the result."

    def __init__(self, kinds: tuple[str, ...] = KINDS, name: str = "calc") -> None:
        self.kinds, self.name = kinds, name

    def make(self, rng: random.Random, index: int) -> Task:
        kind = rng.choice(self.kinds)
        files = {}
        if kind in ("arith", "arith_file"):
            a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(1, 40)
            op1, op2 = rng.choice("+-*"), rng.choice("+-")
            expression = f"{a}{op1}{b}{op2}{c}"
            answer = str(eval(expression))  # digits and + - * only, made just above
            if kind == "arith":
                # "x = 17*23" puts a space before the first number as the prompt does: a byte-level BPE then
                # tokenizes the expression alike in both places, and copying it is token for token.
                prompt, code = f"Compute {expression}.", f"x = {expression}\nprint(x)"
            else:  # the expression is also in a file: the code that evaluates it is the same for every task
                prompt, code = f"Compute {expression} (it is in {EXPRESSION_FILE}).", ARITH_FILE_CODE
                files = {EXPRESSION_FILE: expression + "\n"}
        elif kind == "reverse":
            word = _word(rng)
            prompt, code, answer = f"Reverse the string '{word}'.", f"print('{word}'[::-1])", word[::-1]
        elif kind == "count":
            word = _word(rng)
            letter = rng.choice(word) if rng.random() < 0.8 else rng.choice(string.ascii_lowercase)
            prompt = f"How many times does '{letter}' occur in '{word}'?"
            code, answer = f"print('{word}'.count('{letter}'))", str(word.count(letter))
        else:
            word = _word(rng)
            prompt, code = f"Sort the letters of '{word}'.", f"print(''.join(sorted('{word}')))"
            answer = "".join(sorted(word))
        return Task(id="", prompt=prompt, verifier=Verifier("answer", expected=answer, match="exact"),
                    system=self.system, files=files, tools=("python", "submit", "bash"), limits=LIMITS,
                    meta={"kind": kind, "code": code, "answer": answer})

    def solution(self, task: Task) -> list[tuple[str, dict]]:
        return [("python", {"code": task.meta["code"]}), ("submit", {"answer": task.meta["answer"]})]
