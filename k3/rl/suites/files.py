"""files: find / grep / count questions over a generated directory tree under /work/data. The answer is a
number or a path, checked exactly."""

from __future__ import annotations

import random

from k3.rl.suites.base import Suite
from k3.rl.tasks import EpisodeLimits, Task, Verifier

LIMITS = EpisodeLimits(turns=6, tokens_per_turn=96, total_tokens=1024, seconds=90.0)
ROOT = "/work/data"
DIRS = ["logs", "src", "docs", "notes", "archive", "cache"]
WORDS = ["alpha", "bravo", "charlie", "delta", "ember", "frost", "glade", "haze", "iris", "jade", "karma",
         "lunar", "mossy", "noble", "opal", "prism"]
EXTENSIONS = [".txt", ".log", ".py", ".md"]


def _tree(rng: random.Random) -> dict[str, str]:
    files: dict[str, str] = {}
    for _ in range(rng.randint(6, 14)):
        depth = rng.randint(1, 2)
        parts = [rng.choice(DIRS) for _ in range(depth)]
        name = rng.choice(WORDS) + str(rng.randint(0, 9)) + rng.choice(EXTENSIONS)
        lines = []
        for _ in range(rng.randint(1, 8)):
            level = rng.choice(["INFO", "INFO", "WARN", "ERROR"])
            lines.append(f"{level} {' '.join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))}")
        files["/".join([ROOT, *parts, name])] = "\n".join(lines) + "\n"
    return files


class FilesSuite(Suite):
    name = "files"
    system = "Answer the question about the files under /work/data. Use bash (find, grep, wc), then submit."

    def make(self, rng: random.Random, index: int) -> Task:
        files = _tree(rng)
        kind = rng.choice(["count_ext", "grep_count", "find_word"])
        if kind == "count_ext":
            ext = rng.choice(EXTENSIONS)
            answer = str(sum(path.endswith(ext) for path in files))
            prompt = f"How many files ending in {ext} are there under {ROOT}?"
            command = f"find {ROOT} -type f -name '*{ext}' | wc -l"
        elif kind == "grep_count":
            path = rng.choice(sorted(files))
            answer = str(sum(line.startswith("ERROR") for line in files[path].splitlines()))
            prompt = f"How many lines of {path} start with ERROR?"
            command = f"grep -c '^ERROR' {path}"
        else:
            path = rng.choice(sorted(files))
            marker = f"token{rng.randint(1000, 9999)}"
            files[path] += f"NOTE {marker}\n"
            answer = path
            prompt = f"Which file under {ROOT} contains the word {marker}? Give its full path."
            command = f"grep -rl {marker} {ROOT}"
        return Task(id="", prompt=prompt, verifier=Verifier("answer", expected=answer, match="exact"),
                    system=self.system, files=files, tools=("bash", "read_file", "python", "submit"), limits=LIMITS,
                    meta={"kind": kind, "command": command, "answer": answer})

    def solution(self, task: Task) -> list[tuple[str, dict]]:
        return [("bash", {"command": task.meta["command"]}), ("submit", {"answer": task.meta["answer"]})]
