"""The ``browse`` task suite: multi-hop questions over the offline web, with verifiable answers.

Every task is generated from the facts that the module pages of the corpus state (``corpus.py``),
so its answer can be checked exactly, and it needs two or more pages: the first names the second
(an import, a base class), or the answer compares pages. Kinds:

  base_method       module A's class C derives from a class defined in module B: name the first
                    method of that base class (pages: A, B)
  import_constant   of the modules A imports, one defines constant K (K is defined in several
                    modules of the corpus, with different values): give its value (pages: A, B)
  import_default    of the modules A imports, one defines function f (f is defined in several
                    modules, with different defaults): give the default of parameter p (pages: A, B)
  import_most       of the 2-4 modules A imports, which defines the most top-level functions
                    (pages: A and each import)
  compare_classes   which of modules A and B defines more top-level classes (pages: A, B)

Task schema (one dict per task)::

    {"id": "browse-<kind>-<hash>", "kind": str, "split": "train" | "test",
     "prompt": str,            # the question, with how to answer
     "answer": str,            # exact expected answer (check with check_answer)
     "pages": [url, ...],      # the pages that justify it, in reading order (len >= 2)
     "hops": int,              # len(pages)
     "start": "web://py/..."}  # a page to start from (the first of pages)

Splits are by the first module of a task (a hash of it): no module that starts a test task starts
a train task. The same corpus, n, seed and split always give the same tasks.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict

from k3.sandbox.web.corpus import Corpus, ModuleFacts, module_url

SPLITS = ("train", "test")
TEST_FRACTION = 0.2
MAX_SAME_TARGET = 3
ANSWER_HINT = "Use the web tools (search, open, find) to find out. Reply with the answer only."


def _split_of(module: str) -> str:
    digest = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16)
    return "test" if digest % 1000 < TEST_FRACTION * 1000 else "train"


def _task(kind: str, prompt: str, answer: str, pages: list[str]) -> dict:
    start_module = pages[0].rsplit("/", 1)[-1]
    key = hashlib.sha256(f"{kind}\0{prompt}\0{answer}".encode()).hexdigest()[:12]
    return {"id": f"browse-{kind}-{key}", "kind": kind, "split": _split_of(start_module),
            "prompt": f"{prompt} {ANSWER_HINT}", "answer": answer, "pages": pages, "hops": len(pages),
            "start": pages[0]}


def _public(name: str) -> bool:
    return not name.startswith("_")


def _base_method(modules: dict[str, ModuleFacts]) -> list[dict]:
    tasks = []
    for facts in modules.values():
        for cls in facts.classes.values():
            if not _public(cls.name) or not cls.bases:
                continue
            base, base_module = cls.bases[0], cls.base_modules[0]
            if base_module is None or base_module == facts.name or base_module not in modules:
                continue
            target = modules[base_module].classes.get(base.rsplit(".", 1)[-1])
            if target is None or not target.methods:
                continue
            prompt = (f"In the Python standard library, module `{facts.name}` defines class `{cls.name}`, whose first "
                      f"base class is defined in another module. What is the name of the first method defined in "
                      f"the body of that base class?")
            tasks.append(_task("base_method", prompt, target.methods[0], [module_url(facts.name), module_url(base_module)]))
    return tasks


def _import_constant(modules: dict[str, ModuleFacts]) -> list[dict]:
    values: dict[str, set[str]] = defaultdict(set)
    for facts in modules.values():
        for name, value in facts.constants.items():
            values[name].add(value)
    tasks = []
    for facts in modules.values():
        holders: dict[str, list[str]] = defaultdict(list)
        for imported in facts.imports:
            for name in modules[imported].constants if imported in modules else ():
                holders[name].append(imported)
        for name, where in sorted(holders.items()):
            # Ambiguous alone (several values in the corpus), unique through module A.
            if len(where) != 1 or len(values[name]) < 2 or name in facts.constants:
                continue
            prompt = (f"Exactly one of the standard-library modules that `{facts.name}` imports defines a top-level "
                      f"constant named `{name}`. What is its value, exactly as written in that module's source?")
            tasks.append(_task("import_constant", prompt, modules[where[0]].constants[name],
                               [module_url(facts.name), module_url(where[0])]))
    return tasks


def _import_default(modules: dict[str, ModuleFacts]) -> list[dict]:
    defaults: dict[tuple[str, str], set[str]] = defaultdict(set)
    for facts in modules.values():
        for function, params in facts.functions.items():
            for param, default in params:
                if default is not None:
                    defaults[(function, param)].add(default)
    tasks = []
    for facts in modules.values():
        holders: dict[tuple[str, str], list[str]] = defaultdict(list)
        for imported in facts.imports:
            for function, params in modules[imported].functions.items() if imported in modules else ():
                if not _public(function) or function in facts.functions:
                    continue
                for param, default in params:
                    if default is not None and not param.startswith("_"):
                        holders[(function, param)].append(imported)
        for (function, param), where in sorted(holders.items()):
            if len(where) != 1 or len(defaults[(function, param)]) < 2:
                continue
            value = dict(modules[where[0]].functions[function])[param]
            if len(value) > 40:
                continue
            prompt = (f"Exactly one of the standard-library modules that `{facts.name}` imports defines a top-level "
                      f"function `{function}` with a parameter `{param}`. What is that parameter's default value, "
                      f"exactly as written in the source?")
            tasks.append(_task("import_default", prompt, value, [module_url(facts.name), module_url(where[0])]))
    return tasks


def _import_most(modules: dict[str, ModuleFacts]) -> list[dict]:
    tasks = []
    for facts in modules.values():
        imports = [m for m in facts.imports if m in modules]
        if not 2 <= len(imports) <= 4 or len(imports) != len(facts.imports):
            continue
        counts = sorted(((len(modules[m].functions), m) for m in imports), reverse=True)
        if counts[0][0] == counts[1][0]:
            continue  # a tie has no single answer
        prompt = (f"Of the standard-library modules that `{facts.name}` imports, which one defines the most "
                  f"top-level functions (def statements at module level)? Give its full module name.")
        tasks.append(_task("import_most", prompt, counts[0][1], [module_url(facts.name)] + [module_url(m) for m in imports]))
    return tasks


def _compare_classes(modules: dict[str, ModuleFacts], rng: random.Random, per_module: int = 1) -> list[dict]:
    names = sorted(m for m in modules if _public(m.rsplit(".", 1)[-1]) and modules[m].classes)
    tasks = []
    for a in names:
        for b in rng.sample(names, min(per_module * 3, len(names))):
            if a == b or len(modules[a].classes) == len(modules[b].classes):
                continue
            winner = a if len(modules[a].classes) > len(modules[b].classes) else b
            prompt = (f"Which standard-library module defines more top-level classes: `{a}` or `{b}`? "
                      f"Give the module name.")
            tasks.append(_task("compare_classes", prompt, winner, [module_url(a), module_url(b)]))
            break
    return tasks


def all_browse_tasks(corpus: Corpus) -> list[dict]:
    """Every task the corpus gives, both splits, in a fixed order."""
    modules = corpus.modules
    tasks = (_base_method(modules) + _import_constant(modules) + _import_default(modules) + _import_most(modules)
             + _compare_classes(modules, random.Random(0)))
    unique = {task["id"]: task for task in tasks}
    # Many modules share one base or import (44 encodings.cp* derive from codecs): at most
    # MAX_SAME_TARGET tasks of a kind may end on the same pages, so the suite stays varied.
    seen: dict = defaultdict(int)
    kept = []
    for key in sorted(unique):
        task = unique[key]
        target = (task["kind"], task["answer"], tuple(task["pages"][1:]))
        seen[target] += 1
        if seen[target] <= MAX_SAME_TARGET:
            kept.append(task)
    return kept


def generate_browse_tasks(n: int, seed: int = 0, split: str = "train", corpus: Corpus | None = None) -> list[dict]:
    """``n`` browse tasks of ``split`` ("train" or "test"), drawn with ``seed``, kinds interleaved.

    corpus: default, the standard corpus of this machine (the one ``default_tools()`` serves); the
    tasks are only answerable on the corpus they were generated from. ValueError when the split
    has fewer than ``n`` tasks (the message says how many it has).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative number of tasks, got {n!r}")
    if corpus is None:
        from k3.sandbox.web.tools import default_tools

        corpus = default_tools().corpus
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for task in all_browse_tasks(corpus):
        if task["split"] == split:
            by_kind[task["kind"]].append(task)
    available = sum(len(tasks) for tasks in by_kind.values())
    if n > available:
        raise ValueError(f"the {split} split of this corpus has {available} browse tasks, fewer than the {n} asked for")
    rng = random.Random(seed)
    for kind in sorted(by_kind):
        rng.shuffle(by_kind[kind])
    chosen: list[dict] = []
    kinds = sorted(by_kind)
    while len(chosen) < n:  # round-robin over kinds, so a small n still mixes them
        for kind in kinds:
            if by_kind[kind] and len(chosen) < n:
                chosen.append(by_kind[kind].pop())
    return chosen


def normalize_answer(text: str) -> str:
    """Whitespace, surrounding backticks/quotes once, and a final period removed."""
    text = " ".join(str(text).strip().split())
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1].rstrip()
    text = text.strip("`").strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return text


def check_answer(task: dict, response: str) -> bool:
    """True when ``response`` is the task's answer (after ``normalize_answer`` on both)."""
    return normalize_answer(response) == normalize_answer(task["answer"])
