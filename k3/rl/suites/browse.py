"""browse: multi-hop questions over the offline web (k3.sandbox.web: the standard library and Python docs of
this machine as linked pages), answered with the web tools search / open / find, then submit.

The questions are k3.sandbox.web.tasks' (each needs two or more pages; its answer is checked exactly after
that module's normalisation). Their own split (by a hash of the first module) is kept: its "test" split is
this suite's held-out split, so no module that starts a held-out question starts a training one. Task
``index`` of a split is the index-th question of that split in a fixed shuffled order (wrapping around).
The solver opens the question's pages in order and submits the answer.
"""

from __future__ import annotations

import random

from k3.rl.suites.base import Suite
from k3.rl.tasks import EpisodeLimits, Task, Verifier

LIMITS = EpisodeLimits(turns=8, tokens_per_turn=96, total_tokens=1024, seconds=120.0)
TOOLS = ("search", "open", "find", "submit")


def verify(answer, sandbox, task) -> float:
    """1 when the submitted answer is the question's, after k3.sandbox.web.tasks.normalize_answer."""
    from k3.sandbox.web.tasks import check_answer

    return float(answer is not None and check_answer({"answer": task.meta["answer"]}, answer))


class BrowseSuite(Suite):
    name = "browse"
    system = ("Answer the question from the offline web of Python's documentation: search(query) finds pages, "
              "open(url) reads one (or open(n): the n-th link listed), find(text) searches the open page. "
              "Then submit the answer.")

    def __init__(self, corpus=None) -> None:
        self.corpus = corpus  # None: the standard corpus of this machine (k3.sandbox.web.tools.default_tools)
        self._pools: dict[str, list[dict]] = {}

    def _pool(self, split: str) -> list[dict]:
        if split not in self._pools:
            from k3.sandbox.web.tasks import all_browse_tasks
            from k3.sandbox.web.tools import default_tools

            corpus = self.corpus or default_tools().corpus
            wanted = "test" if split == "heldout" else "train"
            pool = [t for t in all_browse_tasks(corpus) if t["split"] == wanted]
            if not pool:
                raise ValueError(f"the offline web's corpus has no browse questions of split {wanted!r}")
            random.Random(f"browse/{split}").shuffle(pool)
            self._pools[split] = pool
        return self._pools[split]

    def task(self, split: str, index: int) -> Task:
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        pool = self._pool(split)
        item = pool[index % len(pool)]
        return Task(id=f"browse-{split}-{index}", prompt=f"{item['prompt']} Start at {item['start']}.",
                    verifier=Verifier("python", function="k3.rl.suites.browse:verify"), split=split,
                    system=self.system, tools=TOOLS, limits=LIMITS,
                    meta={"answer": item["answer"], "pages": list(item["pages"]), "kind": item["kind"],
                          "question": item["id"]})

    def solution(self, task: Task) -> list[tuple[str, dict]]:
        return [("open", {"url": url}) for url in task.meta["pages"]] + [("submit", {"answer": task.meta["answer"]})]
