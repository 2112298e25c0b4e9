"""One rollout forked into 8 branches from one snapshot; each branch edits and tests its own copy.

A tiny coding task is put in an image: ``calc.py`` has a bug in ``mean`` and ``test_calc.py``
checks it. The rollout sets up the workspace, runs the failing tests, and snapshots. From that one
snapshot, 8 forked sandboxes each try a different edit (as 8 sampled continuations of a policy
would) and run the tests in isolation: a branch sees only its own edit, never another's.

    sudo python examples/sandbox_fork_rollout.py

Needs root (namespaces, overlayfs, cgroups); ``k3 sandbox doctor`` says what is missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from k3.sandbox import Image, Limits, Sandbox, default_image, prewarm

CALC = '''def mean(values):
    return sum(values) / (len(values) + 1)   # bug: off by one


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
'''

TESTS = '''from calc import mean, median

assert mean([1, 2, 3]) == 2, f"mean([1, 2, 3]) = {mean([1, 2, 3])}"
assert mean([5]) == 5
assert median([3, 1, 2]) == 2 and median([4, 1, 3, 2]) == 2.5
print("all tests passed")
'''

# Eight candidate edits of the buggy line, as a policy might sample them; three pass the tests.
CANDIDATES = [
    "    return sum(values) / (len(values) + 1)",
    "    return sum(values) / len(values)",
    "    return sum(values) // len(values)",
    "    return sum(values) / (len(values) - 1)",
    "    return sum(values) / max(len(values), 1)",
    "    return sum(values[1:]) / len(values)",
    "    return values[0]",
    "    return sum(values) * len(values)",
]


def build_task_image(workdir: str) -> Image:
    """The default image (shell, coreutils, python3) plus the task under /work/task."""
    base = default_image()
    image = os.path.join(workdir, "task-image")
    shutil.copytree(base.path, image, symlinks=True, copy_function=os.link)
    task = os.path.join(image, "work", "task")
    os.makedirs(task)
    with open(os.path.join(task, "calc.py"), "w") as f:
        f.write(CALC)
    with open(os.path.join(task, "test_calc.py"), "w") as f:
        f.write(TESTS)
    return Image.from_dir(image, workdir="/work/task")


def run_branch(index: int, box: Sandbox) -> tuple[int, bool, str]:
    """Apply candidate ``index`` in this branch's own copy and run the tests there."""
    source = box.read_file("/work/task/calc.py").decode()
    edited = source.replace(CANDIDATES[0], CANDIDATES[index])
    box.write_file("/work/task/calc.py", edited)
    result = box.exec("python3 test_calc.py", timeout=20)
    last_line = (result.stdout + result.stderr).strip().splitlines()[-1:] or [""]
    return index, result.ok, last_line[0]


def main() -> None:
    workdir = tempfile.mkdtemp(prefix="k3-fork-rollout-")
    try:
        image = build_task_image(workdir)
        with Sandbox(image, Limits(memory_mb=256, pids=64, cpus=1.0)) as rollout:
            first = rollout.exec("python3 test_calc.py")
            print(f"rollout: tests before any edit -> exit {first.exit_code}: {first.stderr.strip().splitlines()[-1]}")
            rollout.write_file("/work/task/NOTES.md", "investigated: mean divides by the wrong count\n")
            prewarm(len(CANDIDATES))  # 8 supervisors started ahead, as a rollout worker keeps them
            start = time.perf_counter()
            snapshot = rollout.snapshot()
            branches = rollout.fork(snapshot, n=len(CANDIDATES))
            print(f"snapshot {snapshot} and 8 forks in {(time.perf_counter() - start) * 1000:.1f} ms")
            try:
                with ThreadPoolExecutor(max_workers=len(branches)) as threads:
                    outcomes = list(threads.map(run_branch, range(len(branches)), branches))
                for index, passed, line in outcomes:
                    print(f"branch {index}: {'PASS' if passed else 'fail'}  {CANDIDATES[index].strip():<45} {line}")
                # Isolation: every branch still holds its own edit, and the rollout none of them.
                for index, box in enumerate(branches):
                    assert CANDIDATES[index] in box.read_file("/work/task/calc.py").decode()
                assert CANDIDATES[0] in rollout.read_file("/work/task/calc.py").decode()
                assert all(box.read_file("/work/task/NOTES.md") for box in branches)
            finally:
                for box in branches:
                    box.close()
            winners = [index for index, passed, _ in outcomes if passed]
            print(f"{len(winners)} of {len(branches)} branches pass: {winners}; each saw only its own edit")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
